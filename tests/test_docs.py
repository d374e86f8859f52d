"""The documentation stays true to the repository.

* every command in docs/ (fenced shell blocks, and inline code of the forms ``make X``,
  ``python -m benchmarks.run X``, ``python recipes/X.py``, ``rlflow X``) names a Makefile
  target, benchmark module, file, CLI subcommand and flags, and config keys that exist;
* every relative link in docs/ and README.md points to an existing file (and heading);
* docs/benchmarks.md is a reference: every benchmark section states its command, machine, load
  and date, every benchmark module has a section, and the index at the top links every section;
* code (rlflow/, benchmarks/, recipes/, kernels/) states no measured figure: no load a figure was
  taken at, no speed-up; those live in docs/benchmarks.md.

Pure text checks: nothing here imports torch or Ray.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

from rlflow.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DOC_PAGES = sorted(DOCS.rglob("*.md"))
LINKED_PAGES = [*DOC_PAGES, ROOT / "README.md"]
BENCHMARKS_PAGE = DOCS / "benchmarks.md"

_FENCE = re.compile(r"^(```|~~~)(\w*)[^\n]*\n(.*?)^\1[ \t]*$", re.DOTALL | re.MULTILINE)
_SHELL_LANGS = ("", "bash", "sh", "shell", "console")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_IMG_SRC = re.compile(r"<img\s[^>]*src=\"([^\"]+)\"")
_SEPARATORS = ("&&", "||", ";", "|", "--")
_PYTHONS = ("python", "python3")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _ids(paths: list[Path]) -> list[str]:
    return [_rel(p) for p in paths]


# ----------------------------------------------------------------------------- what exists


@cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.MULTILINE))


@cache
def bench_modules() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py")))


@cache
def cli_subcommands() -> frozenset[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return frozenset(sub.choices)


@cache
def config_fields() -> dict[str, dict[str, str]]:
    """``{class name: {field: annotation}}`` of the config dataclasses, inherited fields included."""
    import rlflow.trainer.config as config

    classes = {
        name: cls for name, cls in vars(config).items() if isinstance(cls, type) and dataclasses.is_dataclass(cls)
    }
    return {name: {f.name: str(f.type) for f in dataclasses.fields(cls)} for name, cls in classes.items()}


def config_key_error(key: str) -> str | None:
    """Why the dotted override ``key`` is not a config field, or None when it is one."""
    fields, cls, parts, i = config_fields(), "RLFlowConfig", key.split("."), 0
    while i < len(parts):
        if cls is None or parts[i] not in fields.get(cls, {}):
            return f"{key!r}: no field {parts[i]!r} in {cls or 'a plain value'}"
        annotation = fields[cls][parts[i]]
        entry = re.fullmatch(r"dict\[str, (\w+)\]", annotation)
        if entry:  # models.<role>..., placement.manual.<mfc>...
            i, cls = i + 1, entry.group(1)
        else:
            section = re.fullmatch(r"(\w+) \| None", annotation)  # a section that is off when null (models.<role>.lora)
            name = section.group(1) if section else annotation
            cls = name if name in fields else None
        i += 1
    return None


# ----------------------------------------------------------------------------- reading pages


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(2).lower(), m.group(3)) for m in _FENCE.finditer(text)]


def prose(text: str) -> str:
    """The text outside fenced blocks."""
    return _FENCE.sub("", text)


def shell_commands(code: str) -> list[list[str]]:
    """Token lists of the commands of a shell block: continuation lines joined, comments dropped."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:  # not shell (an unlabelled block of prose or a tree): nothing to check
            continue
        if tokens and not tokens[0].startswith(("$", ">>>")):
            commands.append(tokens)
    return commands


def inline_commands(text: str) -> list[list[str]]:
    """Inline code spans that are commands of the checked forms."""
    found = []
    for match in _INLINE_CODE.finditer(prose(text)):
        try:
            tokens = shlex.split(match.group(2))
        except ValueError:
            continue
        tokens = _strip_env(tokens)
        if len(tokens) < 2:
            continue
        program = _program(tokens[0])
        if program in ("make", "rlflow") or (
            program == "python" and (tokens[1] == "-m" or tokens[1].startswith("recipes/"))
        ):
            found.append(tokens)
    return found


def _strip_env(tokens: list[str]) -> list[str]:
    i = 0
    while i < len(tokens) and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[i]):
        i += 1
    return tokens[i:]


def _program(token: str) -> str:
    name = token.rsplit("/", 1)[-1]
    return "python" if name in _PYTHONS else name


def invocations(tokens: list[str]) -> list[tuple[str, list[str], Path]]:
    """``(program, arguments, working directory)`` of every command in a token list.

    Commands are split at shell separators and at ``--`` (``ray job submit ... -- python x.py``);
    ``--working-dir D`` of a ``ray job submit`` makes the command after it run in ``D``.
    """
    segments, current = [], []
    for token in tokens:
        if token in _SEPARATORS:
            segments.append(current)
            current = []
        else:
            current.append(token)
    segments.append(current)
    found, cwd = [], ROOT
    for segment in segments:
        segment = _strip_env(segment)
        if not segment:
            continue
        program = _program(segment[0])
        if program == "ray" and "--working-dir" in segment:
            cwd = ROOT / segment[segment.index("--working-dir") + 1]
        found.append((program, segment[1:], cwd))
    return found


# ----------------------------------------------------------------------------- checking commands


def _placeholder(arg: str) -> bool:
    """``<name>``, ``key=value ...``: words standing for what the reader fills in."""
    return any(mark in arg for mark in ("<", ">", "...", "…"))


def command_problems(tokens: list[str], full: bool) -> list[str]:
    """What is wrong with a documented command; ``full`` also parses flags and config keys."""
    problems = []
    for program, args, cwd in invocations(tokens):
        args = [a for a in args if not _placeholder(a)]
        if program == "make":
            problems += [f"no Makefile target {t!r}" for t in args if "=" not in t and t not in make_targets()]
        elif program == "rlflow":
            problems += _rlflow_problems(args, full)
        elif program == "python" and args[:1] == ["-m"] and len(args) > 1:
            problems += _module_problems(args[1], args[2:])
        elif program == "python" and args and args[0].endswith(".py") and (full or args[0].startswith("recipes/")):
            problems += _script_problems(cwd / args[0], args[1:], full)
    return problems


def _rlflow_problems(args: list[str], full: bool) -> list[str]:
    if args == ["--version"]:  # the top-level option besides --help
        return []
    if not args or args[0] not in cli_subcommands():
        return [f"rlflow has no subcommand {args[:1]}; it has {sorted(cli_subcommands())}"]
    if full:
        try:
            build_parser().parse_args(args)
        except SystemExit:
            return [f"`rlflow {' '.join(args)}` does not parse (see the argparse message above)"]
    return []


def _module_problems(module: str, args: list[str]) -> list[str]:
    if module == "benchmarks.run":
        patterns = [a for a in args if not a.startswith("-")]
        return [
            f"no benchmark module benchmarks/bench_*{p}*.py"
            for p in patterns
            if not any(p in m for m in bench_modules())
        ]
    if module.split(".")[0] not in ("rlflow", "benchmarks"):
        return []  # pip, pytest, ...
    base = ROOT.joinpath(*module.split("."))
    if base.with_suffix(".py").is_file() or (base / "__main__.py").is_file():
        return []
    return [f"no module {module!r} to run with python -m"]


def _script_problems(script: Path, args: list[str], full: bool) -> list[str]:
    if not script.is_file():
        return [f"no script {_rel(script)}"]
    if not full or script.parent != ROOT / "recipes":
        return []
    problems = []
    if args and args[0].endswith((".yaml", ".yml")):
        problems += [] if (script.parent / args[0]).is_file() else [f"no recipe YAML {args[0]}"]
        args = args[1:]
    for arg in args:
        key, sep, _ = arg.partition("=")
        error = config_key_error(key) if sep else f"{arg!r} is not a key=value override"
        problems += [error] if error else []
    return problems


@pytest.mark.parametrize("page", DOC_PAGES, ids=_ids(DOC_PAGES))
def test_documented_commands_exist(page: Path):
    text = page.read_text()
    problems = []
    for lang, code in fenced_blocks(text):
        if lang in _SHELL_LANGS:
            for tokens in shell_commands(code):
                problems += [f"`{shlex.join(tokens)}`: {p}" for p in command_problems(tokens, full=True)]
    for tokens in inline_commands(text):
        problems += [f"`{shlex.join(tokens)}`: {p}" for p in command_problems(tokens, full=False)]
    assert not problems, f"{_rel(page)}:\n" + "\n".join(problems)


def test_command_checker_catches_mistakes():
    """The checks above are only worth something if they fail on wrong commands."""
    assert command_problems(["make", "demo"], full=True) == []
    assert command_problems(["make", "dem0"], full=True)
    assert command_problems(["python", "-m", "benchmarks.run", "planner"], full=True) == []
    assert command_problems(["python", "-m", "benchmarks.run", "no_such_topic"], full=True)
    assert command_problems([".venv/bin/rlflow", "draw", "--algo", "ppo", "--out", "x.svg"], full=True) == []
    assert command_problems([".venv/bin/rlflow", "draw", "--algo", "ppo", "--outfile", "x.svg"], full=True)
    assert command_problems(["rlflow", "nosuchcommand"], full=False)
    recipe = ["python", "recipes/grpo_arithmetic.py", "trainer.total_steps=5", "models.actor.lr=1e-4"]
    assert command_problems(recipe, full=True) == []
    assert command_problems([*recipe, "trainer.total_stepz=5"], full=True)
    assert command_problems(["python", "recipes/no_such_recipe.py"], full=False)
    submit = ["ray", "job", "submit", "--working-dir", "recipes", "--", "python", "grpo_arithmetic.py", "seed=1"]
    assert command_problems(submit, full=True) == []
    assert config_key_error("placement.manual.actor_gen.mesh.num_devices") is None
    assert config_key_error("placement.manual.actor_gen.mesh.devices") is not None
    assert config_key_error("trainer.total_steps.x") is not None


# ----------------------------------------------------------------------------- links


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", prose(page.read_text()), re.MULTILINE):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    text = _INLINE_CODE.sub("", prose(page.read_text()))
    return _LINK.findall(text) + _IMG_SRC.findall(text)


@pytest.mark.parametrize("page", LINKED_PAGES, ids=_ids(LINKED_PAGES))
def test_relative_links_resolve(page: Path):
    problems = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists():
            problems.append(f"{target}: no file {path_part}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            problems.append(f"{target}: no heading #{anchor} in {_rel(path)}")
    assert not problems, f"{_rel(page)}:\n" + "\n".join(problems)


def test_slugs_follow_github():
    assert slug("Planner: building the planning problem (`build_problem`)") == (
        "planner-building-the-planning-problem-build_problem"
    )
    assert slug("Adding an estimator, a policy loss or a reward") == "adding-an-estimator-a-policy-loss-or-a-reward"
    assert slug("## `(top level)`".lstrip("# ")) == "top-level"


# ----------------------------------------------------------------------------- benchmarks page

_SECTION_FIELDS = {
    "command": r"^Commands?:",
    "machine": r"^Machine:",
    "load": r"^Load:",
    "date": r"^Date:.*\b\d{4}-\d{2}-\d{2}\b",
}


def benchmark_sections(text: str) -> dict[str, str]:
    """``{heading: body}`` of the ``##`` sections of a page (fenced blocks kept in the body)."""
    parts = re.split(r"^## +(.+?)\s*$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def benchmark_section_problems(heading: str, body: str) -> list[str]:
    """The fields a benchmark section lacks: a command, a machine, a load and a dated line."""
    return [
        f"section {heading!r} has no line matching {pattern!r} (its {field})"
        for field, pattern in _SECTION_FIELDS.items()
        if not re.search(pattern, body, re.MULTILINE)
    ]


def test_every_benchmark_section_states_command_machine_load_and_date():
    sections = benchmark_sections(BENCHMARKS_PAGE.read_text())
    assert len(sections) >= len(bench_modules()), "docs/benchmarks.md has fewer sections than benchmark modules"
    problems = [p for heading, body in sections.items() for p in benchmark_section_problems(heading, body)]
    assert not problems, "docs/benchmarks.md:\n" + "\n".join(problems)


def test_benchmark_section_check_catches_a_missing_field():
    complete = "Command: `make bench`\nMachine: 2 cores\nLoad: 1.0\nDate: 2026-11-26\n"
    assert benchmark_section_problems("x", complete) == []
    assert benchmark_section_problems("x", complete.replace("Load: 1.0\n", ""))
    assert benchmark_section_problems("x", complete.replace("2026-11-26", "not recorded"))
    assert benchmark_section_problems("x", complete.replace("Command:", "The command is"))


def test_every_benchmark_module_has_a_section():
    """A module's section names it in a command: ``benchmarks.run <name>`` or ``bench_<name>``."""
    sections = benchmark_sections(BENCHMARKS_PAGE.read_text())
    missing = []
    for module in bench_modules():
        name = module.removeprefix("bench_")
        pattern = rf"benchmarks\.run {re.escape(name)}\b|\b{re.escape(module)}\b"
        if not any(re.search(pattern, body) for body in sections.values()):
            missing.append(f"benchmarks/{module}.py")
    assert not missing, f"docs/benchmarks.md has no section whose command runs: {missing}"


def test_benchmark_index_links_every_section():
    text = BENCHMARKS_PAGE.read_text()
    index = text.split("\n## ", 1)[0]
    linked = {target.partition("#")[2] for target in _LINK.findall(index) if target.startswith("#")}
    unlinked = [h for h in benchmark_sections(text) if slug(h) not in linked]
    assert not unlinked, f"the index of docs/benchmarks.md does not link these sections: {unlinked}"


# ----------------------------------------------------------------------------- no measured figures in code

# What a measured figure in a comment looks like: a load it was taken at, or a speed-up. Such
# figures go stale with the code and the machine; they belong in docs/benchmarks.md.
_MEASURED_FIGURE = re.compile(
    r"\b(?:at|under) load (?:average )?(?:of )?[≈~]?\d"
    r"|\bload average (?:of )?[≈~]?\d"
    r"|\d(?:\.\d+)?(?:\s?[-–]\s?\d(?:\.\d+)?)?\s?[x×] (?:faster|slower)\b"
)
CODE_FILES = sorted(
    p
    for folder in ("rlflow", "benchmarks", "recipes", "kernels")
    for p in (ROOT / folder).rglob("*")
    if p.suffix in (".py", ".cpp", ".h", ".yaml") and p.is_file()
)


def measured_figures(text: str) -> list[str]:
    """Lines of ``text`` that state a measured figure (see ``_MEASURED_FIGURE``)."""
    return [line.strip() for line in text.splitlines() if _MEASURED_FIGURE.search(line)]


def test_measured_figure_pattern():
    assert measured_figures("4 MiB took 29 ms with torch.cat at load 10 on 2 cores.")
    assert measured_figures("# (load average 2.6), the sampler")
    assert measured_figures("of HF's modules (2–3× faster per rollout)")
    assert measured_figures("# sdpa 1.4x slower at 64 batches")
    assert measured_figures('"load_average_1min": round(os.getloadavg()[0], 2),') == []
    assert measured_figures("# scaled_dot_product_attention above: the crossover lies between 64 and 128") == []


def test_code_carries_no_measured_figures():
    found = [f"{_rel(p)}: {line}" for p in CODE_FILES for line in measured_figures(p.read_text(errors="replace"))]
    assert not found, "measured figures in code (move them to docs/benchmarks.md):\n" + "\n".join(found)
