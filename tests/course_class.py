"""A class of student copies for timing and testing `grade`: some untouched, some with every other
exercise written, some with all written (each written region holds the repository's own solution).

    python tests/course_class.py ../class        # 10 + 10 + 10 copies: ../class/untouched-01 ... solved-10
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvmini.course.copies import write_student_copy  # noqa: E402
from kvmini.course.exercises import exercises, strip  # noqa: E402


def solve(copy: Path, name: str) -> None:
    """What a student does: every region of `name` in the copy gets a working body (the original's)."""
    for rel in exercises(ROOT)[name].holes:
        still_open = {n for n, ex in exercises(copy).items() if ex.open and rel in ex.holes} - {name}
        (copy / rel).write_text(strip((ROOT / rel).read_text(), still_open)[0])


def make_class(base: Path, each: int = 10, withheld: bool = False) -> list[Path]:
    """`each` untouched copies, `each` with every other exercise written, `each` with all written."""
    names = list(exercises(ROOT))
    copies = []
    for kind, solved in (("untouched", []), ("half", names[::2]), ("solved", names)):
        for i in range(1, each + 1):
            copy = base / f"{kind}-{i:02d}"
            write_student_copy(copy, withheld=withheld)
            for name in solved:
                solve(copy, name)
            copies.append(copy)
    return copies


if __name__ == "__main__":
    made = make_class(Path(sys.argv[1]))
    print(f"wrote {len(made)} copies in {sys.argv[1]}")
