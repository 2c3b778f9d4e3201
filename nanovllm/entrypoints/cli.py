"""The `nanovllm` command: `nanovllm serve|chat|batch ...`, each subcommand's own options after it
(`nanovllm serve --help`). A subcommand's module is imported only when it runs."""
import argparse
import importlib
import sys

# name -> (what it does, its module, whose main(argv) runs it)
COMMANDS = {
    "serve": ("serve a model over an OpenAI-compatible HTTP API", "nanovllm.entrypoints.serve_command"),
    "chat": ("chat with a model in the terminal (in this process, or a server's with --url)",
             "nanovllm.entrypoints.terminal_chat"),
    "batch": ("batch inference over JSONL/Parquet rows on Ray Data (python -m nanovllm.batch)", "nanovllm.batch"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="nanovllm: a small LLM inference engine.",
                                     epilog="`nanovllm COMMAND --help` shows a command's options.")
    commands = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND", required=True)
    for name, (help_text, _) in COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        _parser().parse_args(argv)      # prints the help, or the error, and exits
        return
    command, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[command][1])
    if command == "batch":
        module.main(rest)
    else:
        module.main(rest, prog=f"nanovllm {command}")


if __name__ == "__main__":
    main()
