"""Shell completion scripts generated from the argparse parser itself, so they never drift from it.

bash: a `complete -F` function completing subcommands, each subcommand's flags, the choices
of flags that have them, and file names elsewhere. zsh: the same function through zsh's
bashcompinit (shipped with zsh). No library: the CLI has four subcommands and plain flags;
shtab would add a dependency for what ~40 lines do.
"""

from __future__ import annotations

import argparse

SHELLS = ("bash", "zsh")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps no public list of its actions
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(flag for action in parser._actions for flag in action.option_strings if flag.startswith("--"))


def _choices(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Positional or flag -> its fixed choices."""
    out = {}
    for action in parser._actions:
        if action.choices and not isinstance(action, argparse._SubParsersAction):
            key = action.option_strings[-1] if action.option_strings else "_positional"
            out[key] = [str(c) for c in action.choices]
    return out


def bash_script(parser: argparse.ArgumentParser) -> str:
    prog = parser.prog
    subs = _subparsers(parser)
    cases = []
    for name, sub in subs.items():
        choices = _choices(sub)
        positional = choices.pop("_positional", None)
        flag_cases = "".join(f"                {flag}) COMPREPLY=($(compgen -W '{' '.join(values)}' -- \"$cur\")); return;;\n"
                             for flag, values in choices.items())
        fallback = (f"COMPREPLY=($(compgen -W '{' '.join(positional)}' -- \"$cur\"))" if positional
                    else "COMPREPLY=($(compgen -f -- \"$cur\"))")
        cases.append(
            f"        {name})\n"
            f"            case \"$prev\" in\n{flag_cases}"
            f"            esac\n"
            f"            if [[ \"$cur\" == -* ]]; then COMPREPLY=($(compgen -W '{' '.join(_flags(sub))}' -- \"$cur\"))\n"
            f"            else {fallback}; fi;;\n"
        )
    function = f"_{prog.replace('-', '_')}"
    return (
        f"# {prog} completion (bash): eval \"$({prog} completion bash)\"\n"
        f"{function}() {{\n"
        f"    local cur=\"${{COMP_WORDS[COMP_CWORD]}}\" prev=\"${{COMP_WORDS[COMP_CWORD-1]}}\"\n"
        f"    if (( COMP_CWORD == 1 )); then\n"
        f"        COMPREPLY=($(compgen -W '{' '.join([*subs, *_flags(parser)])}' -- \"$cur\")); return\n"
        f"    fi\n"
        f"    case \"${{COMP_WORDS[1]}}\" in\n{''.join(cases)}"
        f"    esac\n"
        f"}}\n"
        f"complete -o default -F {function} {prog}\n"
    )


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    if shell == "bash":
        return bash_script(parser)
    if shell == "zsh":
        return ("# infermesh completion (zsh): eval \"$(infermesh completion zsh)\"\n"
                "autoload -U +X bashcompinit && bashcompinit\n" + bash_script(parser))
    raise ValueError(f"shell must be one of {', '.join(SHELLS)}, got {shell!r}")
