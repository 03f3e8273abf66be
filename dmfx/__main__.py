"""python -m dmfx demo [...] (see dmfx/demo.py) | python -m dmfx explain [...] (see dmfx/explain.py)."""

import sys

USAGE = """usage:
  python -m dmfx demo [--layers N --hidden H --batch B --seq L --steps S]
  python -m dmfx explain [--model bert-base|gpt2|llama|vit|minilm] [--batch 8] [--seq 128] [--train]
                         [--layers N] [--json out.json] [--measure] [--plot out.png]"""


def main() -> None:
    argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    if argv[0] == "demo":
        from .demo import main as demo

        demo(argv[1:])
    elif argv[0] == "explain":
        from .explain import main as explain

        explain(argv[1:])
    else:
        sys.exit(f"python -m dmfx: unknown command {argv[0]!r} (commands: demo, explain)")


if __name__ == "__main__":
    main()
