"""What the Python checks in this folder share: `check` counts the asserts that held, and `run`
prints `ok: N checks` after `main` (the Rust side requires that line, so a script that checked
nothing cannot pass) or `FAILED: …` with exit status 1."""

import sys

checks = 0


def check(cond, what):
    global checks
    assert cond, what
    checks += 1


def run(main):
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {checks} checks")
