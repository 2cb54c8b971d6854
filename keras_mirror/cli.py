"""The `keras-mirror` console script: `demo` and `launch` subcommands."""

import sys

_USAGE = """usage: keras-mirror {demo,launch} ...

subcommands:
  demo     train a small convnet on scikit-learn's digits over 4 logical CPUs
  launch   start N local workers of a training script with TF_CONFIG set
"""


def main(argv=None):
    """Entry point of the `keras-mirror` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from keras_mirror import demo

        return demo.main(rest)
    if command == "launch":
        from keras_mirror import launch

        return launch.main(rest)
    print(f"keras-mirror: unknown subcommand {command!r}\n{_USAGE}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
