"""python -m dmfx demo [...]: see dmfx/demo.py."""

import sys


def main() -> None:
    argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m dmfx demo [--layers N --hidden H --batch B --seq L --steps S]")
        return
    if argv[0] == "demo":
        from .demo import main as demo

        demo(argv[1:])
    else:
        sys.exit(f"python -m dmfx: unknown command {argv[0]!r} (commands: demo)")


if __name__ == "__main__":
    main()
