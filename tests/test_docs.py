"""Every code block of the README and the documentation site runs as written.

Python blocks run one by one, each in a fresh scope and a fresh working directory. They load the built-in model
by name (``peft_sparse.assets.load_model_and_tokenizer("smollm2-135m-instruct")``); here that name loads a tiny
random Llama with a word-level tokenizer, saved to disk and read through the same loader, so every block runs in
seconds on CPU. The ``slow`` test runs the README's quick start with the real SmolLM2-135M-Instruct.

Bash blocks are checked, not run: every repository path they name exists, every ``peft-sparse`` command line
parses with the CLI's own parser, every pip extra exists. YAML blocks parse. Any other fence is refused, so no
block escapes the tests by its language (``text``: output or a file listing, shown as is).
"""

from __future__ import annotations

import io
import re
import shlex
import socket
import warnings
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import yaml

import peft_sparse.assets

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = "smollm2-135m-instruct"
EXCLUDED = {"docs/perf-log.md"}  # the lab log: excluded from the site (mkdocs.yml, exclude_docs)
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "integrations" / "README.md"] + sorted(
    p for p in (ROOT / "docs").rglob("*.md") if str(p.relative_to(ROOT)) not in EXCLUDED
)
FENCE = re.compile(r"^(`{3,})([\w-]*)[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)
LANGUAGES = {"python", "bash", "yaml", "text"}
SNIPPET = re.compile(r'^--8<-- "([^"]+)"\s*$')


def _blocks() -> list:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", match.group(2), match.group(3)))
    return found


BLOCKS = _blocks()
PYTHON = [(where, code) for where, language, code in BLOCKS if language == "python"]
BASH = [(where, code) for where, language, code in BLOCKS if language == "bash"]


def test_every_fence_has_a_known_language_and_none_is_indented():
    assert len(PAGES) >= 15 and len(PYTHON) >= 20, (len(PAGES), len(PYTHON))
    unknown = [(where, language) for where, language, _ in BLOCKS if language not in LANGUAGES]
    assert not unknown, f"code fences without a language the tests know (python, bash, yaml, text): {unknown}"
    for page in PAGES:
        indented = [i + 1 for i, line in enumerate(page.read_text().splitlines()) if re.match(r"^\s+```", line)]
        assert not indented, f"{page.relative_to(ROOT)}: indented code fences at lines {indented} (the tests read only fences at column 0)"


def test_the_lab_log_is_excluded_from_the_site():
    config = (ROOT / "mkdocs.yml").read_text()
    assert "exclude_docs" in config and all(Path(p).name in config for p in EXCLUDED)


WORDS = "what is plus minus the number comes before after question answer two three four ten seven".split()


def _tiny_tokenizer():
    """A word-level tokenizer (SentencePiece-style "▁" word marks, so synthetic languages find words to rename)
    over the numbers 0–99 and a few words of the examples, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [str(n) for n in range(100)] + WORDS + [w.capitalize() for w in WORDS]
    vocab = {token: i for i, token in enumerate(["<unk>", "<pad>", "</s>"] + [f"▁{w}" for w in words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    out.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
    )
    return out


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama and its tokenizer, saved as a model folder (sizes that bitsandbytes' CPU 4-bit kernels
    accept: in_features a multiple of 64)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-smollm2")
    tokenizer = _tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def tiny_builtin_model(tiny_model_dir, monkeypatch):
    real = peft_sparse.assets.load_model_and_tokenizer

    def load(source, *args, **kwargs):
        assert source == BUILTIN, f"the examples load the built-in model by name, got {source!r}"
        return real(str(tiny_model_dir), *args, **kwargs)

    monkeypatch.setattr(peft_sparse.assets, "load_model_and_tokenizer", load)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(code: str, where: str, monkeypatch) -> dict:
    """Run a block in a fresh scope; fail on a warning raised by peft_sparse itself (the warnings page lists them:
    an example that triggers one is a wrong example)."""
    import torch.distributed as dist

    if "init_process_group" in code:  # a script meant for torchrun: a one-process group, as torchrun would set up
        for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(key, value)
    scope = {"__name__": "__main__"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            exec(compile(code, where, "exec"), scope)
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    package = str(Path(peft_sparse.assets.__file__).parent)
    ours = [f"{w.category.__name__}: {w.message}" for w in caught if w.filename.startswith(package) or "SpIEL" in str(w.message)]
    assert not ours, f"{where} makes peft_sparse warn: {ours}"
    return scope


@pytest.mark.parametrize("where, code", PYTHON, ids=[where for where, _ in PYTHON])
def test_python_block_runs_as_written(where, code, tiny_builtin_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run(code, where, monkeypatch)


def _quick_start() -> tuple:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    (match,) = [m for m in FENCE.finditer(section) if m.group(2) == "python"]
    return "README.md (Quick start)", match.group(3)


@pytest.mark.slow
def test_the_quick_start_teaches_the_real_model_to_add(tmp_path, monkeypatch):
    """The README's quick start, as written, on the real SmolLM2-135M-Instruct: SpIEL reselects on schedule, the
    training loss falls, the adapter loads and the merged model answers the held-out sum."""
    monkeypatch.chdir(tmp_path)
    where, code = _quick_start()
    printed = io.StringIO()
    with redirect_stdout(printed):
        scope = _run(code, where, monkeypatch)
    history = scope["trainer"].state.log_history
    reselections = [entry["spiel/step"] for entry in history if "spiel/replaced" in entry]
    losses = [entry["loss"] for entry in history if "loss" in entry]
    assert reselections == [5, 25] and losses[-1] < losses[0] / 2, (reselections, losses)
    assert (tmp_path / "outputs/quickstart/adapter/adapter_model.safetensors").is_file()
    assert printed.getvalue().strip().splitlines()[-1].strip() == "19"


# ------------------------------------------------------------------------------------------------ bash blocks
def _commands(code: str) -> list:
    """Each command of a bash block (continuation lines joined, split at &&, ||, ; and |), as tokens."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        tokens = shlex.split(line, comments=True)
        command: list = []
        for token in tokens:
            if token in ("&&", "||", ";", "|", "&"):
                commands.append(command)
                command = []
            else:
                command.append(token)
        commands.append(command)
    return [c for c in commands if c]


REPOSITORY_PATH = re.compile(r"^(recipes|benchmarks|integrations|tests|docs|peft_sparse)/[\w./-]*$")


@pytest.mark.parametrize("where, code", BASH, ids=[where for where, _ in BASH])
def test_bash_block_names_real_files_commands_and_extras(where, code):
    from peft_sparse.cli import build_parser

    tomllib = pytest.importorskip("tomllib")  # (Python ≥ 3.11)
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for command in _commands(code):
        for token in command:
            if REPOSITORY_PATH.match(token) and "*" not in token:
                assert (ROOT / token).exists(), f"{where}: {token} does not exist"
            extra = re.fullmatch(r"\.\[([\w,-]+)\]", token)
            if extra:
                unknown = set(extra.group(1).split(",")) - extras
                assert not unknown, f"{where}: pip extras {sorted(unknown)} are not in pyproject.toml"
        cli = None
        if command[0] == "peft-sparse":
            cli = command[1:]
        elif "peft_sparse.cli" in command:
            cli = command[command.index("peft_sparse.cli") + 1 :]
        if cli is not None:
            try:
                build_parser().parse_args(cli)
            except SystemExit:
                pytest.fail(f"{where}: `peft-sparse {' '.join(cli)}` does not parse")
        if command[0] in ("python", "python3") and command[1].endswith(".py"):
            assert (ROOT / command[1]).is_file(), f"{where}: {command[1]} does not exist"


def test_yaml_blocks_parse_and_snippets_exist():
    for where, language, code in BLOCKS:
        snippets = [SNIPPET.match(line) for line in code.splitlines() if line.startswith("--8<--")]
        for snippet in snippets:
            assert snippet and (ROOT / snippet.group(1)).is_file(), f"{where}: snippet {code!r} names no file"
        if language == "yaml" and not snippets:
            yaml.safe_load(code)


def test_links_from_the_readme_and_benchmarks_point_at_files():
    """The site's own links are checked by `mkdocs build --strict`; these two files live outside it."""
    for name in ("README.md", "BENCHMARKS.md"):
        text = (ROOT / name).read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not re.match(r"https?://", target):
                assert (ROOT / target).exists(), f"{name} links to {target}, which does not exist"


CONFIG_PAGES = {
    "sft.md": ["SparseFTConfig"],
    "spiel.md": ["SpIELConfig"],
    "lt-sft.md": ["LTSFTConfig"],
    "s4.md": ["S4Config"],
    "madg.md": ["MADGConfig", "BottleneckConfig"],
    "slow-fast.md": ["SlowFastConfig"],
}


@pytest.mark.parametrize("page, classes", CONFIG_PAGES.items())
def test_configuration_tables_name_real_fields(page, classes):
    """Each method page's configuration table (first column `field`) names fields its config classes have."""
    import dataclasses

    import peft_sparse

    fields = {f.name for name in classes for f in dataclasses.fields(getattr(peft_sparse, name))}
    tables = re.findall(r"^\| field \|.*?\n((?:\|.*\n)+)", (ROOT / "docs" / page).read_text(), re.M)
    cells = [row.split("|")[1] for table in tables for row in table.splitlines()[1:]]  # (the first line: |---|)
    named = {name for cell in cells for name in re.findall(r"`(\w+)`", cell)}
    assert len(named) >= 4, f"{page}: no configuration table found"
    assert named <= fields, f"{page}: the table names {sorted(named - fields)}, which {classes} do not have"
