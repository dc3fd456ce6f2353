"""What the entry points do around Hydra: report user errors in one line, and work before Hydra parses.

``one_line_errors`` wraps every console script's ``main`` and its Hydra task function: a
``fastdecode.errors.UserError`` prints ``error: <message>`` on stderr and exits 2, with no traceback.
``check_command_line`` runs before Hydra: it strips the multi-process launchers' arguments, checks the
overrides with our did-you-mean messages and answers ``--help``. Details: docs/design/cli.md.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastdecode.config import ConfigError

USER_ERROR_EXIT = 2  # the exit code of a user error (argparse's, for a bad command line, too)
# (run directory, its highest ancestor that did not exist) of a command line whose output_dir Hydra is about
# to create: a run refused by a user error removes what Hydra made there (``remove_refused_run_dir``)
_NEW_RUN_DIRS: list[tuple[Path, Path]] = []


def one_line_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with its user errors (``fastdecode.errors.UserError``) printed as one line ``error: <msg>``
    on stderr (rank 0) and exit code 2 (every rank). Inside ``@hydra.main`` (on the task function) too:
    Hydra would otherwise print its banner and a traceback. ``HYDRA_FULL_ERROR=1``: raised as it is."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from fastdecode.errors import UserError

        try:
            return func(*args, **kwargs)
        except UserError as err:
            remove_refused_run_dir()
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            from fastdecode.files.distributed import is_main_process

            if is_main_process():
                sys.stdout.flush()
                line = " ".join(part.strip() for part in str(err).splitlines() if part.strip())
                print(f"error: {line}", file=sys.stderr, flush=True)
            sys.exit(USER_ERROR_EXIT)

    return wrapper


def remove_refused_run_dir() -> None:
    """A refused run leaves nothing it created: the run directory Hydra made for it (``.hydra/`` and the job's
    log), with the parents it made, when it did not exist before the run and holds nothing else (a run
    that wrote results or checkpoints before its error keeps them)."""
    import shutil

    while _NEW_RUN_DIRS:
        run_dir, top = _NEW_RUN_DIRS.pop()
        try:  # best effort: another rank of the launch may be removing (or writing) the same directory
            if not run_dir.is_dir() or any(
                p.name != ".hydra" and p.suffix != ".log" for p in run_dir.iterdir()
            ):
                continue
            shutil.rmtree(run_dir, ignore_errors=True)
            for parent in run_dir.parents:  # the parents Hydra created on the way, while empty
                if top not in (parent, *parent.parents) or any(parent.iterdir()):
                    break
                parent.rmdir()
        except OSError:
            continue


def strip_launcher_args(argv: list[str] | None = None) -> list[str]:
    """Remove ``--local_rank=N`` / ``--local-rank N`` that the DeepSpeed launcher appends.

    Hydra would reject them as unknown overrides; the rank is read from ``LOCAL_RANK`` instead, which
    every launcher (deepspeed, torchrun, accelerate) sets. Edits ``sys.argv`` in place by default.
    """
    args = sys.argv if argv is None else argv
    out, skip = [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg.startswith(("--local_rank=", "--local-rank=")):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
            continue
        if arg in ("--local_rank", "--local-rank") and i + 1 < len(args):
            os.environ.setdefault("LOCAL_RANK", args[i + 1])
            skip = True
            continue
        out.append(arg)
    args[:] = out
    return args


def _parse(argv: list[str]):
    """Hydra's own reading of the command line (flags, overrides), or None if it cannot be read."""
    try:
        from hydra._internal.utils import get_args_parser

        return get_args_parser().parse_args(argv)
    except (ImportError, SystemExit):  # an unreadable command line: Hydra itself will say why
        return None


def _compose(config_name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from fastdecode.config import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


def config_groups(config_name: str) -> list[str]:
    """The config groups that ``configs/<config_name>.yaml`` composes (its defaults list), in order."""
    from omegaconf import OmegaConf

    from fastdecode.config import CONFIG_DIR

    defaults = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / f"{config_name}.yaml")).get("defaults", [])
    names = [next(iter(d)) for d in defaults if isinstance(d, dict)]
    return [n for n in names if not n.startswith(("override", "hydra"))]


def _node_keys(config_name: str, overrides: list[str], parent: str) -> list[str]:
    """The keys at ``parent`` of the config, composed with the overrides that pick group options (they
    decide the tree's shape; a value override cannot)."""
    from omegaconf import OmegaConf

    groups = config_groups(config_name)
    picks = [o for o in overrides if o.split("=")[0].lstrip("+") in groups]
    for attempt in (picks, []):
        try:
            cfg = _compose(config_name, attempt)
            break
        except Exception:  # a bad group option among them: the shape of the defaults will do
            continue
    else:
        return []
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return [str(k) for k in node] if node is not None and OmegaConf.is_dict(node) else []


def _override_error(config_name: str, overrides: list[str], err: Exception) -> Exception | None:
    """Our did-you-mean error for a Hydra composition error, or None when we have nothing better to say."""
    from fastdecode.config import ConfigError, did_you_mean, group_choices, unknown_name_error

    text, cause = str(err), err.__cause__
    if getattr(err, "override", None) is not None:  # hydra.errors.OverrideParseException: its grammar
        return grammar_error(err.override, text)
    # "find": a single option; "load": an option of a list-valued group (decoder=[a,b])
    missing = re.search(r"Could not (?:find|load) '([\w-]+)/([^']+)'", text)
    if missing and missing.group(2) not in group_choices(missing.group(1)):
        group, name = missing.groups()
        return unknown_name_error(group, name, group_choices(group), f"Pick one with {group}=NAME.")
    no_group = re.search(r"Could not override '([\w.]+)'\. No match in the defaults list", text)
    if no_group:
        groups = config_groups(config_name)
        return ConfigError(
            f"'{no_group.group(1)}' is not a config group of {config_name}.{did_you_mean(no_group.group(1), groups)} "
            f"Its groups: {', '.join(groups)}."
        )
    full_key = getattr(cause, "full_key", None)
    if not full_key or "Could not override" not in text:
        return None
    parent, _, key = str(full_key).rpartition(".")
    keys = _node_keys(config_name, [o for o in overrides if not o.startswith(f"{full_key}=")], parent)
    where = f"'{parent}'" if parent else "the config"
    if parent == "trainer":  # every TrainingArguments field is valid; the yaml sets a few of them
        from recipes.trainer_args import unknown_trainer_key

        return unknown_trainer_key(key)
    return ConfigError(
        f"Unknown key '{full_key}'.{did_you_mean(key, keys)} Valid keys of {where}: {', '.join(sorted(keys))}."
    )


def grammar_error(override: str, text: str) -> ConfigError:
    """An override Hydra's grammar cannot read (``text``: Hydra's message): a word without ``=``, an open
    bracket or quote; what is wrong and how overrides are written, in one line."""
    from fastdecode.config import ConfigError

    lines = [
        ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("See https", "Error parsing"))
    ]
    if "=" not in override and not override.startswith("~"):
        why = "it has no '='"
    elif lines and lines[-1].strip() == "^":  # the lexer's: the override, a caret under the bad character
        where = len(lines[-1]) - 1 - len("LexerNoViableAltException: ")
        why = f"Hydra cannot read what starts at {override[where:]!r}"
    else:
        why = "; ".join(lines)  # the parser's reason, e.g. "no viable alternative at input '[a'"
    return ConfigError(
        f"cannot read the override {override!r}: {why}. Write key=value, group=option (a list where the group "
        "takes several: decoder=[a,b]), +key=value to add a key, ~key to remove one."
    )


def checkpoint_is_model(config_name: str, overrides: list[str]) -> list[str]:
    """``checkpoint=PATH`` without ``model=``: the model is the checkpoint (``configs/model/checkpoint.yaml``:
    family, tokenizer, depth and label from the directory), not the config's default model."""
    keys = {o.split("=", 1)[0].lstrip("+") for o in overrides if "=" in o}
    given = any(o.split("=", 1)[1] not in ("", "null") for o in overrides if o.startswith("checkpoint="))
    if given and "model" not in keys and "model" in config_groups(config_name):
        return ["model=checkpoint"]
    return []


def trainer_fields(config_name: str, overrides: list[str]) -> list[str]:
    """``trainer.X=V`` for a ``TrainingArguments`` field the trainer yaml leaves out, rewritten as
    ``+trainer.X=V`` (they are all valid: the group is TrainingArguments), so no ``+`` is needed; a misspelt
    field is left alone and gets the did-you-mean error."""
    if not any(o.startswith("trainer.") for o in overrides) or "trainer" not in config_groups(config_name):
        return []  # nothing to rewrite: no compose, no transformers import
    picks = [o for o in overrides if o.split("=")[0] in config_groups(config_name)]
    present = set(_node_keys(config_name, picks, "trainer"))
    from recipes.trainer_args import training_fields

    fields = training_fields()
    added = []
    for override in list(overrides):
        key, sep, value = override.partition("=")
        name = key.removeprefix("trainer.")
        if sep and key.startswith("trainer.") and name in fields and name not in present:
            overrides.remove(override)
            added.append(f"+trainer.{name}={value}")
    return added


def print_help(config_name: str, overrides: list[str]) -> None:
    """Hydra's ``--help`` page, with only the groups that ``config_name`` composes."""
    from omegaconf import OmegaConf

    from fastdecode.config import group_choices

    app = Path(sys.argv[0]).stem.removeprefix("fastdecode-")
    groups = "\n".join(f"{g}: {', '.join(group_choices(g))}" for g in sorted(config_groups(config_name)))
    print(
        f"{app} is powered by Hydra.\n\n== Configuration groups ==\nCompose your configuration from those "
        f"groups (group=option)\n\n{groups}\n\n\n== Config ==\nOverride anything in the config (foo.bar=value)"
        f"\n\n{OmegaConf.to_yaml(_compose(config_name, overrides))}\n"
        "Powered by Hydra (https://hydra.cc)\nUse --hydra-help to view Hydra specific help\n"
    )


def check_command_line(config_name: str, argv: list[str] | None = None) -> None:
    """Before ``@hydra.main``: ``--help`` is answered here (then exit), and the overrides are composed once
    so a misspelt key or option raises our ConfigError. Multirun sweeps and other config names are left
    to Hydra."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args is None or args.multirun or args.config_name or args.config_path or args.config_dir:
        return
    overrides = [o for o in args.overrides if not o.lstrip("+~").startswith("hydra")]
    before = list(overrides)
    added = checkpoint_is_model(config_name, overrides) + trainer_fields(config_name, overrides)
    if argv is None:  # what Hydra parses next: the rewritten command line
        # first: Hydra's parser reads one run of overrides (one after --cfg job would be refused)
        sys.argv[1:] = added + [a for a in sys.argv[1:] if a in overrides or a not in before]
    overrides += added
    if args.help:
        print_help(config_name, overrides)
        sys.exit(0)
    try:
        cfg = _compose(config_name, overrides)
    except Exception as err:
        ours = _override_error(config_name, overrides, err)
        if ours is not None:
            raise ours from None
        return  # anything else: Hydra reports it in its own words when it composes
    if not args.cfg:
        output_dir = check_output_dir(cfg)
        if output_dir is not None and argv is None and not output_dir.exists():  # Hydra will create it
            top = next(p for p in (output_dir, *output_dir.parents) if p.parent.exists())
            _NEW_RUN_DIRS.append((output_dir, top))


def check_output_dir(cfg) -> Path | None:
    """Hydra creates ``output_dir`` (its run directory) and writes ``.hydra/`` into it before the task runs:
    a read-only one is refused here with ``OutputNotWritableError`` instead of Hydra's raw OSError. Returns
    it (absolute; None when the config has none)."""
    from omegaconf import OmegaConf

    from fastdecode.files.io import check_writable

    try:
        output_dir = OmegaConf.select(cfg, "output_dir")
    except Exception:  # an interpolation that cannot resolve yet: the run itself will say why
        return None
    if not output_dir:
        return None
    check_writable(output_dir)
    return Path(output_dir).absolute()
