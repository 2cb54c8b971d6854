"""The `keras-mirror` console script: one argparse program with subcommands.

```
keras-mirror --version
keras-mirror demo [--replicas N] [--epochs N] ...
keras-mirror launch -n 2 -- python train.py
```

Nothing here imports TensorFlow: `--version`, `--help` and usage errors
answer at once, and `demo` checks its own dependencies before paying
TensorFlow's start-up. `launch` hands its arguments to
`keras_mirror.launch.main`, whose parser owns its options.
"""

import argparse
import sys

from keras_mirror import demo
from keras_mirror.version import __version__

PROG = "keras-mirror"


def build_parser():
    """The `keras-mirror` parser, with the `demo` and `launch` subcommands."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Exact synchronous data-parallel training of an "
        "existing Keras 3 model on tf.distribute.",
        epilog=f"Run `{PROG} <subcommand> --help` for a subcommand's "
        "options.",
    )
    parser.add_argument("--version", action="version",
                        version=f"{PROG} {__version__}")
    subcommands = parser.add_subparsers(
        title="subcommands", dest="command", metavar="{demo,launch}")
    demo.add_arguments(subcommands.add_parser(
        "demo", help=demo.HELP, description=demo.DESCRIPTION,
        prog=f"{PROG} demo"))
    # Listed for `--help` only: `main` hands `launch ...` to launch.main.
    subcommands.add_parser(
        "launch", add_help=False,
        help="start N local workers of a training script with TF_CONFIG "
        "set (options: `keras-mirror launch --help`)")
    return parser


def main(argv=None):
    """Entry point of the `keras-mirror` console script; returns the code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        from keras_mirror import launch

        return launch.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return demo.run(args)


if __name__ == "__main__":
    sys.exit(main())
