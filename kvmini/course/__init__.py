"""Course mode: kvmini's mechanisms as exercises for a class.

    python -m kvmini.course new ../student     # a copy with the solutions stripped (--withhold-references)
    python -m kvmini.course check ema_merging  # in a copy: that exercise's tests, pass/fail each
    python -m kvmini.course grade ../alice ../bob   # from the repository: student x exercise, -j copies at once

exercises (the declarations) <- cells (what a tutorial cell asks: solved, usable) and copies (new)
<- grading (check, grade; running the tests through `running`, each exercise under `limits`).
docs/course.md is the instructors' guide.
"""
