"""The docs cannot drift: every command and YAML block of README.md and docs/*.md is checked against the code.

- shell blocks (and the lines of unlabelled blocks that start with a command): each `lit-pretrain ...`,
  `.venv/bin/lit-pretrain ...` or `python -m lit_pretrain.cli ...` (also after srun/torchrun) parses with the CLI's
  own parser (the scaling, ladder and launch commands with theirs); train/prepare/show with a run file that exists
  load it with their overrides through config.load, as `lit-pretrain show` does; a `memory` example counts what a
  run of its layout holds (bf16-mixed-policy where FSDP2's mixed-precision policy is the default); each `make X`
  names a target;
- YAML blocks load into the schema (run files), or as the ladder grid / sweep / ablation file their keys say;
- every config key in backticks (`trainer.max_steps`, `data.sources[i].weight`) exists in the schema;
- every `lit_pretrain/...` path and relative link names a file that exists;
- docs/configuration.md equals what lit_pretrain.schema_doc generates.

User paths: a command that names a corpus or tokenizer of the reader's own (`data.paths='[/path/to/books]'`) is
loaded with check_inputs=False, which skips only the existence of data.paths and the callbacks.extra import; every
other command and YAML block loads with check_inputs=True, so a callback module the docs name must import.
"""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from lit_pretrain import cli, config, schema_doc
from lit_pretrain.launch.commands import launch_parser
from lit_pretrain.scaling import cli as scaling_cli
from lit_pretrain.scaling.ladder.run import ladder_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = ("run", "model", "data", "optim", "schedule", "trainer", "strategy", "callbacks", "checkpoint")
USER_INPUTS = ("data.paths", "data.val_paths", "data.sources", "callbacks.extra")
FILE_SUFFIX = r"\.(py|yaml|json|md|csv|safetensors)$"
PLACEHOLDER = re.compile(r"^[A-Z_]+(\.yaml)?$")  # RUN.yaml, RUN_FILE: a name the reader fills in


def _blocks(page: Path):
    """(language, first line number, text) of each fenced block."""
    lines = page.read_text().split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if m:
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            yield m.group(1), i + 2, "\n".join(lines[i + 1:j])
            i = j
        i += 1


def _commands(text: str, shell: bool):
    """Logical lines (continuations joined), with `name="value"` variables of the block expanded."""
    vars_ = {}
    for line in text.replace("\\\n", " ").split("\n"):
        line = line.strip()
        m = re.match(r'^(\w+)="([^"]*)"$', line)
        if shell and m:
            vars_[m.group(1)] = m.group(2)
            continue
        for name, value in vars_.items():
            line = line.replace(f"${name}", value)
        if line:
            yield line


def _cli_argv(line: str, shell: bool):
    """The arguments after the lit-pretrain command in this line, or None when it runs no lit-pretrain command."""
    if not shell and line.split()[0] not in ("lit-pretrain", ".venv/bin/lit-pretrain"):
        return None  # a listing (the layout, make's help): only a line that starts with the command is one
    try:
        words = shlex.split(line, comments=True)
    except ValueError as err:
        pytest.fail(f"cannot split {line!r}: {err}")
    for i, word in enumerate(words):
        if word in ("lit-pretrain", ".venv/bin/lit-pretrain"):
            if not shell and i:  # a listing: only a line that starts with the command
                return None
            return words[i + 1:]
        if word == "-m" and i + 1 < len(words) and words[i + 1] == "lit_pretrain.cli":
            return words[i + 2:]
    return None


def _make_targets() -> set:
    return set(re.findall(r"^([a-zA-Z_-]+):", (ROOT / "Makefile").read_text(), re.M))


def _check_cli(argv: list, where: str) -> None:
    if argv and re.match(r"^\S+:$", argv[0]):  # an error message quoted in a block: `lit-pretrain train: error: ...`
        return
    command = argv[0] if argv else ""
    try:
        if command in ("fit", "plan", "memory"):
            args = scaling_cli._parser().parse_args(argv)
            if getattr(args, "run", None):
                assert (ROOT / args.run).exists(), f"{where}: {args.run} does not exist"
            elif command == "memory":
                _check_precision(args, where)
            return
        if command == "ladder":
            args = ladder_parser().parse_args(argv[1:])
            if args.grid:
                from lit_pretrain.scaling.ladder.grid import load_grid

                load_grid(ROOT / args.grid)
            return
        if command == "launch":
            launch_parser().parse_intermixed_args(argv[1:])
            return
        if command == "simulate":  # its own parser (lit_pretrain/simulate/cli.py); the run file loads as train's
            from lit_pretrain.simulate.cli import parser as simulate_parser

            args = simulate_parser().parse_args(argv[1:])
            config.load(ROOT / args.run_file, args.overrides, check_inputs=False)
            return
        args = cli._parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `lit-pretrain {' '.join(argv)}` does not parse (the parser's message is above)")
    run_file = getattr(args, "run_file", None)
    if command in ("train", "prepare", "show", "import") and run_file and not PLACEHOLDER.match(run_file):
        path = ROOT / run_file
        assert path.exists(), f"{where}: run file {run_file} does not exist"
        user = any(o.split("=", 1)[0] in USER_INPUTS for o in args.overrides)
        try:
            config.load(path, args.overrides, check_inputs=not user)
        except Exception as err:  # the loader's ConfigError names the key; say which doc line it came from
            pytest.fail(f"{where}: `lit-pretrain {' '.join(argv)}` does not load: {err}")


def _check_precision(args, where: str) -> None:
    """A `memory` example of a layout whose bf16-mixed runs get FSDP2's mixed-precision policy by default
    (planning/plan.py) must count what those runs hold: --precision bf16-mixed would add autocast's weight copies,
    which such a run never makes."""
    from types import SimpleNamespace

    from lit_pretrain.planning.plan import mixed_precision_policy_for

    strategy = SimpleNamespace(mixed_precision_policy=None, expert_parallel=args.expert_parallel)
    degrees = {"tensor_parallel": args.tensor_parallel, "pipeline_parallel": args.pipeline_parallel}
    assert not mixed_precision_policy_for(strategy, SimpleNamespace(precision=args.precision), args.zero_stage,
                                          degrees), (
        f"{where}: a bf16-mixed run with this layout runs FSDP2's mixed-precision policy (strategy."
        "mixed_precision_policy null): write --precision bf16-mixed-policy, which counts what it holds")


def _check_yaml(text: str, where: str, tmp_path: Path) -> None:
    data = yaml.safe_load(text)
    assert isinstance(data, dict), f"{where}: a YAML block is a mapping"
    keys = set(data)
    if {"run_file", "models"} <= keys:  # a ladder grid (compute_limit_flops) or a sweep file (budgets_flops)
        from lit_pretrain.scaling.ladder.grid import load_grid
        from lit_pretrain.scaling.sweep import load_sweep

        path = tmp_path / "grid.yaml"
        path.write_text(text)
        (load_grid if "compute_limit_flops" in keys else load_sweep)(path)
        return
    if {"run", "arms"} <= keys:  # an ablation file
        assert (ROOT / "experiments" / "ablations" / data["run"]).exists(), f"{where}: {data['run']} does not exist"
        return
    unknown = keys - {"defaults", *SECTIONS}
    assert not unknown, f"{where}: {sorted(unknown)} are neither config sections nor a known kind of YAML file"
    # Inside experiments/runs/, so the defaults resolve from the shipped experiments as a run file there does.
    path = ROOT / "experiments" / "runs" / f".doc-block-{tmp_path.name}.yaml"
    path.write_text(text)
    user = "sources" in data.get("data", {}) or "paths" in data.get("data", {})
    try:
        config.load(path, [], check_inputs=not user)
    except Exception as err:
        pytest.fail(f"{where}: the YAML block does not load: {err}")
    finally:
        path.unlink()


def _cases():
    for page in PAGES:
        for lang, line, text in _blocks(page):
            yield pytest.param(page, lang, text, id=f"{page.relative_to(ROOT)}:{line}")


@pytest.mark.parametrize("page, lang, text", list(_cases()))
def test_block(page, lang, text, tmp_path):
    where = f"{page.relative_to(ROOT)} (block `{text.split(chr(10))[0][:60]}`)"
    if lang == "yaml":
        _check_yaml(text, where, tmp_path)
    elif lang == "python":
        compile(text, where, "exec")
    elif lang in ("bash", "sh", ""):
        shell = lang != ""
        for line in _commands(text, shell):
            words = line.split()
            if words[0] == "make":
                target = next((w for w in words[1:] if "=" not in w), None)
                assert target in _make_targets(), f"{where}: `make {target}` is not a Makefile target"
                continue
            argv = _cli_argv(line, shell)
            if argv is not None:
                _check_cli(argv, f"{where}, line `{line[:80]}`")
    else:
        pytest.fail(f"{where}: a block of unknown language {lang!r}: label it bash, yaml, python or nothing")


def _inline_code(text: str):
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.findall(r"`([^`\n]+)`", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_backticked_keys_exist(page):
    keys = schema_doc.keys()
    missing = []
    for span in _inline_code(page.read_text()):
        for word in span.split():
            m = re.match(r"^([a-z_]+(?:\.[a-z_0-9]+|\[\w*\])+)", word)
            if not m or m.group(1).split(".")[0] not in SECTIONS or re.search(FILE_SUFFIX, word):
                continue  # not a config key, or a file named like one (model.safetensors)
            key = re.sub(r"\[\w*\]", "", m.group(1))
            if key not in keys:
                missing.append(key)
    assert not missing, f"{page.name} names config keys the schema lacks: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_and_links_exist(page):
    text = page.read_text()
    missing = [p for p in re.findall(r"lit_pretrain/[\w/.]*\w/?", text) if not (ROOT / p).exists()]
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http") and not (page.parent / target).exists():
            missing.append(target)
    assert not missing, f"{page.name} names paths that do not exist: {sorted(set(missing))}"


def test_configuration_reference_is_current():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == schema_doc.reference(), (
        f"docs/configuration.md is out of date with the config schema: regenerate it with "
        f"`{schema_doc.REGENERATE}` (or `make docs`) and commit it")
