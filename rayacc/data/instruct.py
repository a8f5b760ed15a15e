"""`rayacc data prepare --instruct`: instruction data → token Parquet with a `loss_mask`.

Each JSONL line is one example: `{"prompt", "completion"}` (the prompt's tokens, then the
completion's and the end of text) or `{"messages": [{"role", "content"}, …]}` rendered with the
tokenizer's own chat template. The mask counts the completion, or the assistant turns (what the
template adds for each assistant message after the generation prompt), or every token
(`count="all"`). Rows hold one example each (padded per micro-batch when read), or with `pack`
several whole examples up to `seq_len + 1` tokens and a `documents` column numbering them, so
that attention stays inside each (`gpt` and `hf` take it; models/gpt.py). Longer examples are
cut to `seq_len + 1` tokens; an example left with no counted target is refused naming its line,
or skipped with `skip_empty`; both are said in numbers. Written beside the target and renamed
into place, as `prepare` does.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rayacc.data.common import (
    CHAT_KEY,
    CUT_KEY,
    MASK_RULE_KEY,
    ORIGIN_KEY,
    TOKENIZER_KEY,
    VOCAB_SIZE_KEY,
    DataError,
)

__all__ = [
    "COUNTS",
    "InstructResult",
    "Renderer",
    "check_cut",
    "prepare_instructions",
    "renderer",
]

FORMAT_FIX = (
    'Fix: one example per line: {"prompt": text, "completion": text} or {"messages": '
    '[{"role": text, "content": text}, …]} with an assistant message'
)
COUNTS = ("answers", "all")
"""What the mask counts: the completions / assistant turns, or every token."""
ROLES = ("system", "user", "assistant", "tool")
"""The roles of the field's chat format (OpenAI's, transformers' templates): every template is
taken to know them, and whatever else it names."""
_NAMED_ROLE = re.compile(r"""role['"]?\]?\s*==\s*['"]([A-Za-z0-9_-]+)['"]""")
"""A role a template compares with (`message['role'] == 'ipython'`): linear, no nesting."""


class EmptyAnswer(DataError):
    """An assistant turn or completion with nothing in it: refused, or skipped (`skip_empty`)."""


@dataclass(frozen=True)
class InstructResult:
    out: str
    rows: int
    examples: int
    tokens: int
    counted: int
    truncated: int
    skipped: int
    vocab_size: int
    lost: int = 0
    """Counted tokens the cuts took off (answers cut short)."""
    cut_lines: tuple[str, ...] = ()
    """`file:line` of each example whose counted tokens a cut shortened (the first 20)."""


@dataclass(frozen=True)
class Renderer:
    """One example (a JSON record) → (token ids, 0/1 counted per token); DataError names why
    a record cannot be rendered (the caller adds the file and line)."""

    encode: Callable[[str], list[int]]
    chat: Callable[[list[dict]], tuple[list[int], list[int]]] | None
    bos: list[int]
    eos: list[int]
    vocab_size: int
    described: str
    recorded: bytes
    chat_recorded: bytes = b""
    """The chat set-up (`chat_setup`) as JSON, where a template renders the chats."""

    def example(self, record: object) -> tuple[list[int], list[int]]:
        if not isinstance(record, dict):
            raise DataError(f"a {type(record).__name__}, not a JSON object. {FORMAT_FIX}")
        if "messages" in record:
            messages = _messages(record["messages"])
            if self.chat is None:
                raise DataError(
                    "chat messages need a chat template. Fix: --tokenizer FOLDER of a "
                    "transformers tokenizer whose tokenizer_config.json holds a chat_template"
                )
            return self.chat(messages)
        missing = [k for k in ("prompt", "completion") if k not in record]
        if missing:
            raise DataError(
                f"no {' or '.join(repr(k) for k in missing)} (found {sorted(record)}). {FORMAT_FIX}"
            )
        for key in ("prompt", "completion"):
            if not isinstance(record[key], str):
                raise DataError(
                    f"{key!r} is a {type(record[key]).__name__}, not text. {FORMAT_FIX}"
                )
        if not record["completion"].strip():
            raise EmptyAnswer(
                "an empty 'completion' (it would train the end of text straight after the "
                "prompt). Fix: give it its answer, leave the line out, or --skip-empty"
            )
        prompt = self.bos + self.encode(record["prompt"])
        answer = self.encode(record["completion"]) + self.eos
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def _messages(value: object) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(
            f"'messages' is not a non-empty list of {{role, content}} objects. {FORMAT_FIX}"
        )
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not {"role", "content"} <= set(m):
            raise DataError(
                f"messages[{i}] is not an object with 'role' and 'content'. {FORMAT_FIX}"
            )
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            raise DataError(f"messages[{i}]: 'role' and 'content' must be text. {FORMAT_FIX}")
    return value


def template_roles(template: str) -> frozenset[str]:
    """The roles a chat template knows: the field's (`ROLES`) and those it names."""
    return frozenset(ROLES) | frozenset(_NAMED_ROLE.findall(template))


def _checked_turns(messages: list[dict], roles: frozenset[str], folder: str) -> None:
    """Every role one the template knows (one it does not would be rendered as text of no
    one's, or dropped); an assistant turn to learn from; none of them empty."""
    for i, m in enumerate(messages):
        if m["role"] not in roles:
            raise DataError(
                f"messages[{i}]: role {m['role']!r} is not one the chat template of {folder} "
                f"knows ({', '.join(sorted(roles))}). Fix: use one of them (an answer to learn "
                "from is an assistant's)"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(
            "no assistant message: nothing to learn from. Fix: end the conversation with the "
            "assistant's answer, or leave it out"
        )
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and not m["content"].strip():
            raise EmptyAnswer(
                f"messages[{i}]: an empty assistant turn (it would train the end of turn "
                "straight after the header). Fix: give it its answer, leave the line out, or "
                "--skip-empty"
            )


def renderer(tokenizer: str | None) -> Renderer:
    """Byte-level (no tokenizer: prompt/completion only), a `tokenizer.json`, or a transformers
    tokenizer folder (or a tokenizer.json with its tokenizer_config.json beside it)."""
    if tokenizer is None:
        return Renderer(
            lambda text: list(text.encode("utf-8")), None, [], [256], 257, "byte-level", b"bytes"
        )
    path = Path(tokenizer).expanduser()
    folder = path if path.is_dir() else path.parent
    if (folder / "tokenizer_config.json").is_file():
        return _hf_renderer(folder)
    if path.is_dir():
        raise DataError(
            f"--tokenizer {tokenizer}: the folder holds no tokenizer_config.json. Fix: give the "
            "folder a transformers tokenizer was saved in (save_pretrained), or a tokenizer.json"
        )
    from rayacc.data.prepare import _tokenizer

    tok = _tokenizer(str(path))
    return Renderer(
        lambda text: tok.encode(text).tolist(),
        None,
        [],
        [],
        tok.vocab_size,
        tok.described,
        tok.recorded,
    )


def _hf_renderer(folder: Path) -> Renderer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(
            f"--tokenizer {folder}: a tokenizer folder needs transformers. Fix: pip install "
            "'rayacc[hf]'"
        ) from None
    try:
        # local files only, and no code a folder names is run
        tok = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:
        raise DataError(
            f"--tokenizer {folder}: transformers cannot load it ({type(exc).__name__}: "
            f"{str(exc)[:300]}). Fix: give the folder a tokenizer was saved in (save_pretrained)"
        ) from None
    if not getattr(tok, "is_fast", False):
        raise DataError(
            f"--tokenizer {folder}: not a fast tokenizer (no tokenizer.json). Fix: save the "
            "tokenizer with tokenizers installed, so the folder holds tokenizer.json"
        )

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    bos = [] if tok.bos_token_id is None else [tok.bos_token_id]
    eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
    chat = _chat(tok, folder) if getattr(tok, "chat_template", None) else None
    return Renderer(
        encode,
        chat,
        bos if getattr(tok, "add_bos_token", False) else [],
        eos,
        len(tok),
        f"tokenizer {folder.name} ({len(tok)} ids)",
        tok.backend_tokenizer.to_str().encode("utf-8"),
        json.dumps(chat_setup(tok)).encode("utf-8") if chat is not None else b"",
    )


def chat_setup(tok) -> dict[str, str]:
    """What a chat tokenizer adds to its vocabulary: its template, its special tokens and the
    template's end of turn (the first special token after an assistant's answer: where
    generation stops)."""
    setup = {"chat_template": tok.chat_template}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = getattr(tok, key, None)
        if isinstance(value, str) and value:
            setup[key] = value
    answer = "rayacc-answer"
    try:
        text = tok.apply_chat_template(
            [{"role": "user", "content": "?"}, {"role": "assistant", "content": answer}],
            tokenize=False,
        )
    except Exception:  # a template with rules of its own: no end of turn known
        return setup
    after = text[text.rfind(answer) + len(answer) :]
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items()
                                          if t.special}  # fmt: skip
    for token_id in tok(after, add_special_tokens=False)["input_ids"]:
        if token_id in special:
            setup["end_of_turn"] = tok.convert_ids_to_tokens(token_id)
            break
    return setup


def _chat(tok, folder: Path) -> Callable[[list[dict]], tuple[list[int], list[int]]]:
    """The conversation rendered by the template once, and again up to each assistant turn
    (with the generation prompt): what each assistant message adds is counted. A template
    that does not render a message (drops an unknown role) or whose renderings are not
    prefixes of each other is refused."""

    def render(messages: list[dict], generation: bool) -> str:
        try:
            return tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation
            )
        except Exception as exc:  # jinja's TemplateError, raise_exception(...) in the template
            raise DataError(
                f"the chat template of {folder.name} refused the messages ({str(exc)[:200]}). "
                "Fix: use the roles the template knows (often system, user, assistant), in the "
                "order it expects"
            ) from None

    roles = template_roles(tok.chat_template if isinstance(tok.chat_template, str) else "")

    def chat(messages: list[dict]) -> tuple[list[int], list[int]]:
        _checked_turns(messages, roles, folder.name)
        full = render(messages, False)
        spans, before = [], ""
        for i, m in enumerate(messages):
            upto = render(messages[: i + 1], False)
            if m["content"] and m["content"] not in upto[len(before) :]:
                raise DataError(
                    f"messages[{i}]: the chat template of {folder.name} does not render role "
                    f"{m['role']!r}. Fix: use the roles the template knows"
                )
            if m["role"] == "assistant":
                start = render(messages[:i], True) if i else ""
                if not upto.startswith(start) or not full.startswith(upto):
                    raise DataError(
                        f"the chat template of {folder.name} renders a conversation's start "
                        "differently from the whole conversation: the assistant turns cannot "
                        "be found. Fix: a template whose renderings extend each other"
                    )
                spans.append((len(start), len(upto)))
            before = upto
        encoded = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        counted = [int(any(lo <= a < hi for lo, hi in spans)) for a, _ in encoded["offset_mapping"]]
        return ids, counted

    return chat


def _records(path: Path, shown: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed record) of each non-empty line; DataError naming the line."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(
                    f"{shown}, line {line_no}: not UTF-8 text. Fix: convert the file to UTF-8"
                ) from None
            if line.strip():
                yield line_no, _parsed(line, shown, line_no)


def _parsed(line: str, shown: str, line_no: int) -> object:
    try:
        return json.loads(line)
    except (json.JSONDecodeError, RecursionError) as exc:
        why = getattr(exc, "msg", "nested deeper than the parser follows")
        raise DataError(
            f"{shown}, line {line_no}: not JSON ({why}). Fix: one JSON object per line"
        ) from None


@dataclass
class _Rows:
    """Rows of a part waiting to be written, and what was said of them."""

    tokens: list[list[int]] = dataclasses.field(default_factory=list)
    masks: list[list[int]] = dataclasses.field(default_factory=list)
    documents: list[list[int]] = dataclasses.field(default_factory=list)
    """Packed rows: each token's example, numbered from 0 in the row."""


def prepare_instructions(
    inputs: list[str],
    out: str,
    *,
    seq_len: int = 128,
    tokenizer: str | None = None,
    count: str = "answers",
    pack: bool = False,
    skip_empty: bool = False,
    rows_per_group: int = 64,
    progress: Callable[[str], None] | None = None,
) -> InstructResult:
    """Instruction JSONL files (local) → token Parquet with `loss_mask` under `out` (a new
    folder); see the module doc."""
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    if count not in COUNTS:
        raise DataError(f"--count {count!r}: one of {', '.join(COUNTS)}")
    target = Path(out).expanduser().resolve()
    if target.is_file() or (target.is_dir() and any(target.iterdir())):
        raise DataError(f"--out {out} exists and is not empty. Fix: give a new folder")
    files = _jsonl_files(inputs)
    render = renderer(tokenizer)
    width = seq_len + 1
    rows, stats = _Rows(), dict(examples=0, tokens=0, counted=0, truncated=0, skipped=0, lost=0)
    cut_lines: list[str] = []
    answers_cut = 0
    packed: tuple[list[int], list[int], list[int]] = ([], [], [])
    for path, shown in files:
        for line_no, record in _records(path, shown):
            try:
                ids, counted = render.example(record)
            except EmptyAnswer as exc:
                if not skip_empty:
                    raise DataError(f"{shown}, line {line_no}: {exc}") from None
                stats["skipped"] += 1
                continue
            except DataError as exc:
                raise DataError(f"{shown}, line {line_no}: {exc}") from None
            if count == "all":
                counted = [1] * len(ids)
            if len(ids) > width:
                stats["truncated"] += 1
                if lost := sum(counted[width:]):
                    stats["lost"] += lost
                    answers_cut += 1
                    if len(cut_lines) < 20:
                        cut_lines.append(f"{shown}:{line_no}")
                ids, counted = ids[:width], counted[:width]
            if pack:
                counted = [0, *counted[1:]]  # no example's first token follows from the last
            if not any(counted[1:]):
                if not skip_empty:
                    cut = f" after the cut to --seq-len {seq_len}" if len(ids) == width else ""
                    raise DataError(
                        f"{shown}, line {line_no}: no token counts as a target{cut}. Fix: give "
                        "it a non-empty answer, raise --seq-len, or --skip-empty"
                    )
                stats["skipped"] += 1
                continue
            stats["examples"] += 1
            stats["tokens"] += len(ids)
            stats["counted"] += sum(counted[1:])
            if not pack:
                rows.tokens.append(ids)
                rows.masks.append(counted)
                continue
            if len(packed[0]) + len(ids) > width:
                rows.tokens.append(packed[0])
                rows.masks.append(packed[1])
                rows.documents.append(packed[2])
                packed = ([], [], [])
            number = packed[2][-1] + 1 if packed[2] else 0
            packed[0].extend(ids)
            packed[1].extend(counted)
            packed[2].extend([number] * len(ids))
    if packed[0]:
        rows.tokens.append(packed[0])
        rows.masks.append(packed[1])
        rows.documents.append(packed[2])
    if not rows.tokens:
        raise DataError(
            f"the inputs ({', '.join(s for _, s in files[:3])}) hold no example with a counted "
            "token. Fix: give examples with answers"
        )
    metadata = {
        VOCAB_SIZE_KEY: str(render.vocab_size).encode(),
        ORIGIN_KEY: render.described.encode(),
        TOKENIZER_KEY: render.recorded,
        MASK_RULE_KEY: count.encode(),
        **({CHAT_KEY: render.chat_recorded} if render.chat_recorded else {}),
        CUT_KEY: json.dumps({"seq_len": seq_len, "examples": answers_cut,
                             "lost": stats["lost"], "counted": stats["counted"]}).encode(),
    }  # fmt: skip
    _write(rows, target, render.vocab_size, rows_per_group, metadata)
    result = InstructResult(str(target), len(rows.tokens), vocab_size=render.vocab_size,
                            cut_lines=tuple(cut_lines), **stats)  # fmt: skip
    say(
        f"{out}: {result.examples:,} examples in {result.rows:,} rows "
        f"({'packed, each example attending to itself' if pack else 'one example a row'})"
        f", {result.tokens:,} tokens of which {result.counted:,} count as targets "
        f"({count}); {result.truncated:,} cut to {width} tokens, {result.skipped:,} skipped "
        "with nothing counted"
    )
    if result.lost:
        share = result.lost / (result.counted + result.lost)
        more = f" (and {answers_cut - len(cut_lines)} more)" if answers_cut > len(cut_lines) else ""
        say(
            f"{out}: the cut to {width} tokens took {result.lost:,} of the answers' counted "
            f"tokens ({share:.1%}) from: {', '.join(cut_lines)}{more}. Fix: a larger --seq-len "
            "(the job's data.seq_len), or shorter examples"
        )
    return result


def check_cut(source: str, metadata: dict[bytes, bytes], seq_len: int) -> None:
    """Instruction data cut shorter than the job trains (`data.seq_len`) lost answers the job
    has room for: refused at launch, naming both lengths and what the cut took (DataError)."""
    raw = metadata.get(CUT_KEY)
    if raw is None:
        return
    try:
        cut = json.loads(raw)
        prepared, examples = int(cut["seq_len"]), int(cut["examples"])
        lost, counted = int(cut["lost"]), int(cut["counted"])
    except (ValueError, TypeError, KeyError):
        raise DataError(
            f"data.source={source!r}: its {CUT_KEY.decode()!r} metadata is malformed. Fix: "
            "prepare the data again with `rayacc data prepare --instruct`"
        ) from None
    if examples and prepared < seq_len:
        share = lost / max(lost + counted, 1)
        raise DataError(
            f"data.source={source!r} was prepared with --seq-len {prepared}, which cut "
            f"{examples:,} examples' answers ({share:.1%} of their counted tokens), and the "
            f"job's data.seq_len is {seq_len}. Fix: prepare it again with --seq-len {seq_len} "
            f"(or `rayacc data prepare -c JOB`), or set data.seq_len={prepared}"
        )


def _jsonl_files(inputs: list[str]) -> list[tuple[Path, str]]:
    files = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            inner = sorted(p for p in path.rglob("*") if p.is_file())
            files += [(p, str(p)) for p in inner]
        elif path.is_file():
            files.append((path, item))
        else:
            raise DataError(f"{item}: no such file or folder. Fix: give instruction JSONL files")
    if not files:
        raise DataError(f"{', '.join(inputs)}: no files. Fix: give instruction JSONL files")
    return files


def _write(rows: _Rows, target: Path, vocab: int, rows_per_group: int, metadata) -> None:
    dtype = pa.uint16() if vocab <= 1 << 16 else pa.int32()
    columns = {
        "tokens": pa.array(rows.tokens, pa.list_(dtype)),
        "loss_mask": pa.array([np.asarray(m, np.uint8) for m in rows.masks], pa.list_(pa.uint8())),
    }
    if rows.documents:
        columns["documents"] = pa.array(rows.documents, pa.list_(pa.uint16()))
    table = pa.table(columns).replace_schema_metadata(metadata)
    staging = target.parent / f".{target.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        pq.write_table(table, staging / "part-00000.parquet", row_group_size=rows_per_group)
        if target.exists():
            target.rmdir()
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
