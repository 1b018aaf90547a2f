"""``supervisorctl completion bash|zsh``: a completion script made from the CLI's own parser."""

from __future__ import annotations

import argparse
from collections.abc import Iterable


def completion_script(shell: str, parser: argparse.ArgumentParser, run_commands: Iterable[str]) -> str:
    """A completion script for ``shell``, made from the parser itself; run ids and node
    names are asked of the daemon when completing (``runs -q``, ``nodes -q``). ``run_commands``:
    the commands besides the reads that take a run."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands: dict[str, list[str]] = {}
    for name, p in sub.choices.items():
        commands[name] = sorted(o for a in p._actions for o in a.option_strings)
    takes_run = [n for n in commands
                 if n in {"status", "events", "checkpoints", "goodput", "logs", *run_commands}]
    takes_node = ["drain", "undrain", "probe"]
    cases = "\n".join(f"        {name}) opts=\"{' '.join(opts)}\" ;;"
                      for name, opts in sorted(commands.items()))
    script = _BASH.replace("@COMMANDS@", " ".join(sorted(commands))).replace("@CASES@", cases)
    script = script.replace("@RUN_COMMANDS@", "|".join(sorted(takes_run)))
    script = script.replace("@NODE_COMMANDS@", "|".join(takes_node))
    if shell == "zsh":
        return "autoload -U +X bashcompinit && bashcompinit\n" + script
    return script


_BASH = r"""# supervisorctl completion (bash); eval "$(supervisorctl completion bash)"
_supervisorctl() {
    local cur=${COMP_WORDS[COMP_CWORD]} cmd="" opts="" i
    for ((i = 1; i < COMP_CWORD; i++)); do
        case ${COMP_WORDS[i]} in
            --url|--token-file|--config) ((i++)) ;;
            -*) ;;
            *) cmd=${COMP_WORDS[i]}; break ;;
        esac
    done
    if [[ -z $cmd ]]; then
        COMPREPLY=($(compgen -W "@COMMANDS@ --url --json --token-file --config --help" -- "$cur"))
        return
    fi
    case $cmd in
@CASES@
    esac
    if [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
        return
    fi
    case $cmd in
        @RUN_COMMANDS@) COMPREPLY=($(compgen -W "$(supervisorctl runs -q 2>/dev/null)" -- "$cur")) ;;
        @NODE_COMMANDS@) COMPREPLY=($(compgen -W "$(supervisorctl nodes -q 2>/dev/null)" -- "$cur")) ;;
        submit) COMPREPLY=($(compgen -f -X '!*.toml' -- "$cur") $(compgen -d -- "$cur")) ;;
        completion) COMPREPLY=($(compgen -W "bash zsh" -- "$cur")) ;;
    esac
}
complete -F _supervisorctl supervisorctl"""
