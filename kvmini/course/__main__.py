"""python -m kvmini.course new | check | grade (docs/course.md)."""
import os
import sys
from pathlib import Path

from kvmini import cli
from kvmini.course.exercises import ROOT

LIMIT = 60  # seconds for one exercise's tests (4-7 s measured on a 2-core machine: docs/course.md)


def parser() -> cli.OneLineParser:
    p = cli.OneLineParser(prog="python -m kvmini.course",
                          description="Course mode: hand out a student copy of kvmini, check an exercise, grade a class.")
    commands = p.add_subparsers(dest="command", required=True, parser_class=cli.OneLineParser)
    new = commands.add_parser("new", help="write a student copy with the mechanisms left as exercises")
    new.add_argument("dest", type=cli.path, help="folder for the copy (new or empty, outside the repository)")
    new.add_argument("--only", nargs="+", metavar="NAME", help="strip only these exercises (default: all)")
    new.add_argument("--withhold-references", action="store_true",
                     help="hand out the tests with their literal references replaced by stored outputs")
    new.add_argument("--student", default="", help="the student's name, for the grade table (default: the folder's name)")
    check = commands.add_parser("check", help="run one exercise's tests (or every exercise's) in a copy")
    check.add_argument("name", nargs="?", default="all", help="the exercise (default: all of them, one line each)")
    check.add_argument("dir", type=cli.path, nargs="?", default=".", help="the copy (default: the current folder)")
    check.add_argument("--timeout", type=cli.seconds, default=LIMIT,
                       help=f"seconds for one exercise's tests (default {LIMIT})")
    grade = commands.add_parser("grade", help="a table student x exercise over student copies")
    grade.add_argument("dirs", type=cli.path, nargs="+", metavar="DIR", help="student copies (made with `new`)")
    grade.add_argument("--out", type=cli.path, default=str(ROOT.parent / "kvmini-grades"),
                       help="folder for grades-<time>.json and .csv (default: kvmini-grades/ beside the repository)")
    grade.add_argument("-j", "--jobs", type=lambda t: cli.whole_number(t, 1, 256), default=os.cpu_count() or 1,
                       help=f"copies graded at once (default: the machine's cores, {os.cpu_count()})")
    grade.add_argument("--timeout", type=cli.seconds, default=LIMIT,
                       help=f"seconds for one exercise's tests in one copy (default {LIMIT})")
    return p


def model_not_prepared() -> None:
    """One line on stderr when this repository's default model is not prepared yet: the guide's `ln -s`
    line, the next step of a hand-out, would link the copy to a folder that is not there."""
    from kvmini.weights import DEFAULT_MODEL_DIR

    if not (DEFAULT_MODEL_DIR / "model.safetensors").exists():
        print(f"note: {DEFAULT_MODEL_DIR} is not prepared yet, so a link to it (docs/course.md's `ln -s` line) would "
              "dangle: prepare it first with `python -m kvmini.weights`, or let the copy prepare its own on first use",
              file=sys.stderr)


def main(argv=None) -> int:
    def work():
        args = parser().parse_args(argv)
        if args.command == "new":
            from kvmini.course.copies import describe, write_student_copy

            names = write_student_copy(Path(args.dest), names=args.only, withheld=args.withhold_references,
                                       student=args.student)
            print(describe(Path(args.dest), names))
            model_not_prepared()
            return 0
        from kvmini.course import grading

        if args.command == "check":
            return grading.check(Path(args.dir), args.name, args.timeout)
        return grading.grade([Path(d) for d in args.dirs], Path(args.out), args.timeout, args.jobs)

    return cli.run(work)


if __name__ == "__main__":
    sys.exit(main())
