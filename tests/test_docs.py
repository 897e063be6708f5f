"""The README and docs/ say only what the repository holds and the CLI accepts.

- every relative link (``[text](path)``, ``path#anchor``) in ``README.md`` and ``docs/*.md`` names a file or
  folder that exists (and, into a Markdown page, one of its headings), and so does every backticked
  repository path (``benchmarks/bench_train.py``, ``configs/tiny_hstu.toml``, ``examples/deepfm_ft.py`` ...);
- every command line of their bash blocks parses: ``freescale <sub> ...`` through the CLI's own parser and
  config overrides (``freescale.cli.main``'s path, nothing run), ``python path.py`` and ``launch ... -- python
  path.py`` name a file that exists, ``make <target>`` a target of the Makefile, ``FREESCALE_FAULTS=...`` a
  fault spec ``freescale.testing`` accepts;
- the README stays a front door (at most 250 lines, ``## Two commands`` with ``make test`` in a bash block:
  what ``.ci/run`` runs), and no product document speaks of the workspace it was written in.

The checks are functions (``link_errors``, ``path_errors``, ``command_errors``) so the last tests can show that
each one fails on a broken input.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`([^`]+)`")  # a code span may run over a line break
# A backticked repository path: one of the repository's folders, then more path; a file with an extension or a folder.
REPO_PATH = re.compile(
    r"^(?:benchmarks|examples|configs|docs|freescale|ft|dataloader|kernels|tests|scripts|requirements)/"
    r"[\w./-]*$"
)
FORBIDDEN = ("../shared", "/work/shared", "in the workspace", "the workspace")


def _doc_id(path: Path) -> str:
    return str(path.relative_to(REPO))


def _prose(text: str) -> str:
    """The text outside fenced code blocks (code may hold brackets that are not links)."""
    return FENCE.sub("", text)


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#{1,6} (.+)$", _prose(text), re.M)}


def link_errors(text: str, base: Path) -> list[str]:
    """Relative links of ``text`` (a document in folder ``base``) whose target, or heading, does not exist."""
    errors = []
    for target in LINK.findall(_prose(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # http(s)://, mailto:, own anchors
            continue
        path, _, anchor = target.partition("#")
        if not (base / path).exists():
            errors.append(f"link to {target}: {path} does not exist")
        elif REPO not in (base / path).resolve().parents and (base / path).resolve() != REPO:
            errors.append(f"link to {target}: outside the repository")
        elif anchor and path.endswith(".md") and anchor not in anchors((base / path).read_text()):
            errors.append(f"link to {target}: {path} has no heading '#{anchor}'")
    return errors


def path_errors(text: str) -> list[str]:
    """Backticked repository paths of ``text`` that do not exist (placeholders and globs skipped)."""
    errors = []
    for code in INLINE_CODE.findall(_prose(text)):
        for word in code.split():
            word = word.rstrip(",;:)").split("#", 1)[0]
            if not REPO_PATH.match(word) or any(c in word for c in "*<>{}[]"):
                continue
            if "." not in word.rsplit("/", 1)[-1] and not word.endswith("/"):
                continue  # a module path like freescale/ft without a suffix is prose, not a file
            if not (REPO / word).exists():
                errors.append(f"`{word}` does not exist")
    return errors


def bash_blocks(text: str) -> Iterator[str]:
    for lang, body in FENCE.findall(text):
        if lang in ("bash", "sh", "shell", "console"):
            yield body


def command_lines(block: str) -> Iterator[list[str]]:
    """The simple commands of a bash block: continuations joined, comments dropped, split at ; && || | &."""
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        command: list[str] = []
        for token in lexer:
            if token and set(token) <= set(";&|"):
                if command:
                    yield command
                command = []
            else:
                command.append(token)
        if command:
            yield command


_state: dict[str, Any] = {}


def _parser() -> Any:
    if "parser" not in _state:
        from freescale.cli_parser import build_parser

        _state["parser"] = build_parser(with_config_keys=False)
    return _state["parser"]


def _freescale_errors(argv: list[str]) -> list[str]:
    """``freescale ARGV`` parsed the way ``freescale.cli.main`` parses it, without running anything."""
    from freescale.cli_parser import _reject_unknown_options, _trainer_config_cls
    from freescale.config import ConfigError, load_config

    command: list[str] = []
    if argv[:1] == ["launch"] and "--" in argv:
        argv, command = argv[:argv.index("--")], argv[argv.index("--") + 1:]
        if not command:
            return ["nothing after --"]
    parser = _parser()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            args, rest = parser.parse_known_args(argv)
    except SystemExit as exc:
        if exc.code == 0:  # --help
            return []
        return [f"rejected by the parser: {out.getvalue().strip()}"]
    try:
        _reject_unknown_options(parser.commands[args.command], rest, overrides=args.command in ("train", "launch"))
        if args.command in ("train", "launch"):
            if args.config and not (REPO / args.config).is_file():
                return [f"--config {args.config} does not exist"]
            load_config(_trainer_config_cls(), REPO / args.config if args.config else None, rest)
    except (ConfigError, argparse.ArgumentError) as exc:
        return [str(exc)]
    return _python_errors(command) if command else []


def _python_errors(argv: list[str]) -> list[str]:
    """``python path.py ...``: the script exists (``python -m module`` is not checked)."""
    if not argv or not re.match(r"^(python3?|.*/python3?)$", argv[0]):
        return []
    script = argv[1] if len(argv) > 1 else ""
    if script.endswith(".py") and not (REPO / script).is_file():
        return [f"{script} does not exist"]
    return []


def _fault_errors(spec: str) -> list[str]:
    """What the launcher would refuse in a ``FREESCALE_FAULTS`` value (its own parser, ``testing.parse_faults``)."""
    from freescale.config import ConfigError
    from freescale.testing import parse_faults

    try:
        parse_faults(spec)
    except ConfigError as exc:
        return [str(exc)]
    return []


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (REPO / "Makefile").read_text(), re.M))


def command_errors(argv: list[str]) -> list[str]:
    """What is wrong with one simple command of a bash block (empty: nothing, or not ours to check)."""
    errors: list[str] = []
    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):  # VAR=value before the command
        name, _, value = argv[0].partition("=")
        if name == "FREESCALE_FAULTS":
            errors += _fault_errors(value)
        argv = argv[1:]
    if not argv:
        return errors
    if argv[0] == "freescale":
        return errors + _freescale_errors(argv[1:])
    if argv[0] == "torchrun" and "-m" in argv and argv[argv.index("-m") + 1:][:1] == ["freescale.cli"]:
        return errors + _freescale_errors(argv[argv.index("-m") + 2:])
    if argv[0] == "make":
        targets = _make_targets()
        return errors + [f"make {t}: no such target" for t in argv[1:] if not t.startswith("-") and "=" not in t
                         and t not in targets]
    return errors + _python_errors(argv)


# ----- the documents ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_relative_links_and_repository_paths_exist(doc: Path) -> None:
    text = doc.read_text()
    errors = link_errors(text, doc.parent) + path_errors(text)
    assert not errors, f"{_doc_id(doc)}:\n  " + "\n  ".join(errors)


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_command_in_a_bash_block_parses(doc: Path) -> None:
    errors = []
    for block in bash_blocks(doc.read_text()):
        for argv in command_lines(block):
            errors += [f"{shlex.join(argv)}\n    {e}" for e in command_errors(argv)]
    assert not errors, f"{_doc_id(doc)}:\n  " + "\n  ".join(errors)


def test_readme_is_a_front_door_with_the_ci_test_command() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "README.md: keep it a front door; topics go to docs/"
    section = text.split("\n## Two commands\n", 1)
    assert len(section) == 2, "README.md: the '## Two commands' section is gone (.ci/run runs its test command)"
    first_block = next(bash_blocks(section[1].split("\n## ", 1)[0]), "")
    assert ["make", "test"] in list(command_lines(first_block)), "README.md: `make test` left the Two commands block"
    assert "exec make test" in (REPO / ".ci" / "run").read_text(), "CI no longer runs the README's test command"


def test_every_docs_page_is_on_the_readme_map() -> None:
    readme = (REPO / "README.md").read_text()
    missing = [p.name for p in DOCS[1:] if f"](docs/{p.name})" not in readme]
    assert not missing, f"README.md's documentation map lacks {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_product_documents_do_not_speak_of_the_workspace(doc: Path) -> None:
    text = doc.read_text().lower()
    found = [s for s in FORBIDDEN if s in text]
    assert not found, f"{_doc_id(doc)} mentions {found}"


# ----- the checks themselves fail on broken input -------------------------------------------------------------------
def test_the_checks_catch_what_they_are_for() -> None:
    assert link_errors("see [x](docs/no_such_page.md#a)", REPO) == [
        "link to docs/no_such_page.md#a: docs/no_such_page.md does not exist"]
    assert link_errors("see [x](docs/design.md#layout) and [y](https://example.com/a) and [z](#top)", REPO) == []
    assert link_errors("see [x](docs/design.md#no-such-heading)", REPO) == [
        "link to docs/design.md#no-such-heading: docs/design.md has no heading '#no-such-heading'"]
    assert link_errors("```bash\necho [x](nowhere.md)\n```\n", REPO) == []
    assert path_errors("run `benchmarks/bench_nothing.py` and `configs/tiny_hstu.toml`") == [
        "`benchmarks/bench_nothing.py` does not exist"]
    assert path_errors("`<train.output_dir>/checkpoints/` and `benchmarks/results/gpu_all_h100*.json`") == []
    block = "make tset\nfreescale launch --replicas 2 \\\n    --pipeline.kind plain -- python examples/none.py  # x\n"
    lines = list(command_lines(block))
    assert lines == [["make", "tset"], ["freescale", "launch", "--replicas", "2", "--pipeline.kind", "plain", "--",
                                        "python", "examples/none.py"]]
    assert command_errors(lines[0]) == ["make tset: no such target"]
    assert command_errors(lines[1]) == ["examples/none.py does not exist"]
    assert command_errors(["FREESCALE_FAULTS=1:0:5:explode", "true"])


def test_the_command_check_uses_the_cli_parser_and_the_config_tree() -> None:
    assert command_errors(shlex.split("freescale train --config configs/tiny_hstu.toml --train.steps 20")) == []
    assert command_errors(shlex.split("freescale prepare data/x.csv --out d --user u --item i --time t")) == []
    assert command_errors(shlex.split("freescale lunch --config configs/tiny_hstu.toml"))
    assert command_errors(shlex.split("freescale launch --replicaz 2 --config configs/tiny_hstu.toml"))
    assert command_errors(shlex.split("freescale train --config configs/tiny_hstu.toml --train.stpes 20"))
    assert command_errors(shlex.split("freescale train --config configs/tiny_hstu.toml --train.steps many"))
    assert command_errors(shlex.split("freescale train --config configs/no_such.toml"))
    assert command_errors(shlex.split("freescale gen-log --out x --no-such-flag"))
