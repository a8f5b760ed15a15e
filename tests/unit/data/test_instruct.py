"""`rayacc data prepare --instruct`: prompt/completion and chat JSONL → tokens and a `loss_mask`
that counts the answers (the chat rendered by the tokenizer's own template); packing, cuts and
skips said in numbers; bad instruction data named by file and line with the fix, and nothing
half-written; a `loss_mask` column checked when a source is read, and applied to the targets
when rows are taken."""

from __future__ import annotations

import itertools
import json
import re
from functools import cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayacc.cli import main
from rayacc.config import ConfigError
from rayacc.data.bundled import CHAT_TEMPLATE, chat_tokenizer
from rayacc.data.common import DataError
from rayacc.data.instruct import prepare_instructions
from rayacc.data.rows import LocalRows
from rayacc.data.sources import describe_dataset
from rayacc.engine import IGNORE_INDEX

pytest.importorskip("transformers")

CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6, of course."},
]


def quiet(line: str) -> None:
    pass


@cache
def _tokenizer(root: str) -> Path:
    return chat_tokenizer(Path(root) / "tokenizer")


@pytest.fixture
def tokenizer(tmp_path_factory) -> Path:
    return _tokenizer(str(tmp_path_factory.getbasetemp() / "chat-tokenizer"))


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def rows(out: Path) -> list[dict]:
    return pq.read_table(out).to_pylist()


def decode(tokenizer: Path, ids) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer)).decode(list(ids))


def test_a_chat_counts_its_assistant_turns_and_their_ends_only(tmp_path, tokenizer):
    out = tmp_path / "out"
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    result = prepare_instructions([str(src)], str(out), tokenizer=str(tokenizer), progress=quiet)
    (row,) = rows(out)
    counted = [t for t, m in zip(row["tokens"], row["loss_mask"], strict=True) if m]
    assert decode(tokenizer, counted) == "4.<|end|>6, of course.<|end|>"
    assert decode(tokenizer, row["tokens"]).startswith("<|system|>Answer briefly.<|end|><|user|>")
    assert (result.examples, result.rows, result.counted) == (1, 1, len(counted))
    info = describe_dataset(str(out))
    assert info.loss_mask and info.vocab_size == 261
    # a tokenizer.json with its tokenizer_config.json beside it: the same
    again = tmp_path / "again"
    prepare_instructions(
        [str(src)], str(again), tokenizer=str(tokenizer / "tokenizer.json"), progress=quiet
    )
    assert rows(again) == rows(out)


def test_a_prompt_and_completion_count_the_completion_and_the_end(tmp_path, tokenizer):
    out = tmp_path / "out"
    src = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q: 1+1?", "completion": " A: 2"}])
    prepare_instructions([str(src)], str(out), progress=quiet)  # byte-level
    (row,) = rows(out)
    assert bytes(row["tokens"][:-1]) == b"Q: 1+1? A: 2" and row["tokens"][-1] == 256
    assert row["loss_mask"] == [0] * len("Q: 1+1?") + [1] * (len(" A: 2") + 1)
    prepare_instructions(
        [str(src)], str(tmp_path / "all"), count="all", tokenizer=str(tokenizer), progress=quiet
    )
    (row,) = rows(tmp_path / "all")
    assert set(row["loss_mask"]) == {1} and decode(tokenizer, row["tokens"][-1:]) == "<|endoftext|>"


def test_packing_keeps_examples_whole_and_counts_no_first_token(tmp_path, tokenizer):
    records = [{"messages": CHAT[1:3]}] * 7 + [{"prompt": "p" * 5, "completion": "c" * 3}] * 5
    src = write_jsonl(tmp_path / "mix.jsonl", records)
    out, seq_len = tmp_path / "packed", 40
    result = prepare_instructions(
        [str(src)], str(out), seq_len=seq_len, tokenizer=str(tokenizer), pack=True, progress=quiet
    )
    table = rows(out)
    assert result.examples == 12 and len(table) == result.rows < 12
    assert all(len(r["tokens"]) <= seq_len + 1 for r in table)
    text = "".join(decode(tokenizer, r["tokens"]) for r in table)
    assert text.count("<|user|>What is 2 + 2?<|end|><|assistant|>4.<|end|>") == 7
    assert text.count("pppppccc") == 5
    # each token's example, numbered in its row; whole examples, in order
    for r in table:
        docs = r["documents"]
        assert len(docs) == len(r["tokens"]) and docs[0] == 0
        assert all(b - a in (0, 1) for a, b in itertools.pairwise(docs))
    assert sum(r["documents"][-1] + 1 for r in table) == 12
    assert describe_dataset(str(out)).documents
    # a row's examples start uncounted: nothing is learnt across their boundary
    for r in table:
        starts = [i for i, t in enumerate(r["tokens"]) if decode(tokenizer, [t]) == "<|user|>"]
        assert all(r["loss_mask"][i] == 0 for i in starts)


def test_cuts_and_skips_are_said_in_numbers(tmp_path, tokenizer):
    long = {"prompt": "x" * 50, "completion": "y" * 50}
    src = write_jsonl(tmp_path / "cut.jsonl", [long, {"messages": CHAT[1:3]}, long])
    said = []
    result = prepare_instructions(
        [str(src)],
        str(tmp_path / "o"),
        seq_len=40,
        tokenizer=str(tokenizer),
        skip_empty=True,
        progress=said.append,
    )
    # the cut keeps 41 tokens, all of the long prompt: nothing counted, skipped
    assert (result.truncated, result.skipped, result.examples) == (2, 2, 1)
    assert "2 cut to 41 tokens, 2 skipped with nothing counted" in said[-2], said
    assert "cut.jsonl:1, " in said[-1] and "cut.jsonl:3. Fix:" in said[-1], said
    with pytest.raises(DataError, match="line 1: no token counts as a target after the cut"):
        prepare_instructions([str(src)], str(tmp_path / "o2"), seq_len=40, progress=quiet)


def test_answers_cut_short_are_named_by_line_with_the_share_lost(tmp_path, tokenizer):
    """A count alone ("147 cut to 129 tokens") left the user to find which answers lost how
    much: each line whose counted tokens a cut took is named, with the share of them lost."""
    short = {"prompt": "q", "completion": "fine"}
    cut = {"prompt": "q", "completion": "y" * 60}
    src = write_jsonl(tmp_path / "mixed.jsonl", [short, cut, short, cut])
    said = []
    result = prepare_instructions([str(src)], str(tmp_path / "o"), seq_len=40,
                                  tokenizer=str(tokenizer), progress=said.append)  # fmt: skip
    assert result.cut_lines == (f"{src}:2", f"{src}:4") and result.lost > 0
    whole = 2 * (len("fine") + 1) + 2 * (60 + 1)  # each answer and its end of text
    assert result.counted + result.lost == whole, (result.counted, result.lost)
    share = f"{result.lost / whole:.1%}"
    assert f"took {result.lost} of the answers' counted tokens ({share})" in said[-1], said
    assert f"{src}:2, {src}:4. Fix: a larger --seq-len" in said[-1], said


def test_data_cut_shorter_than_the_job_trains_is_refused_at_launch(tmp_path, tokenizer, capsys):
    """Half the chats cut to 41 tokens went on to train at data.seq_len 512: the cut is
    recorded with the data, and a job that trains longer rows than the data was cut to is
    refused at launch naming both lengths; `data prepare -c JOB` takes the job's length."""
    import yaml

    from rayacc.config import TrainConfig
    from rayacc.driver.prelaunch import prepare

    cut = {"prompt": "q", "completion": "y" * 60}
    src = write_jsonl(tmp_path / "long.jsonl", [cut, {"prompt": "q", "completion": "ok"}] * 4)
    out = tmp_path / "cut"
    prepare_instructions([str(src)], str(out), seq_len=40, tokenizer=str(tokenizer),
                         progress=quiet)  # fmt: skip
    gpt = {"name": "gpt", "n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 128}
    job = {"data": {"source": str(out), "val_fraction": 0.0, "seq_len": 100}, "model": gpt,
           "batch": {"global_batch_size": 2, "micro_batch_size": 1},
           "scaling": {"num_workers": 1}, "tracking": {"enabled": False}}  # fmt: skip
    with pytest.raises(DataError) as error:
        prepare(TrainConfig.from_dict(job))
    text = str(error.value)
    assert "was prepared with --seq-len 40, which cut 4 examples' answers" in text, text
    assert "data.seq_len is 100" in text and "--seq-len 100" in text, text
    assert "set data.seq_len=40" in text, text
    # the job at the data's length runs
    assert prepare(TrainConfig.from_dict({**job, "data": {**job["data"], "seq_len": 40}}))
    # prepared for the job: --seq-len is its data.seq_len, nothing cut
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    again = tmp_path / "again"
    assert main(["data", "prepare", "--instruct", str(src), "--out", str(again),
                 "--tokenizer", str(tokenizer), "-c", str(path)]) == 0  # fmt: skip
    capsys.readouterr()
    assert prepare(TrainConfig.from_dict({**job, "data": {**job["data"], "source": str(again)}}))
    assert (
        json.loads(pq.read_schema(sorted(again.glob("*.parquet"))[0]).metadata[b"rayacc.cut"])[
            "seq_len"
        ]
        == 100
    )


BAD = [
    ("not JSON", '{"prompt": oops}', "not JSON"),
    ("a list", "[1, 2]", "a list, not a JSON object"),
    ("no fields", {"question": "q"}, "no 'prompt' or 'completion' (found ['question'])"),
    ("no completion", {"prompt": "q"}, "no 'completion'"),
    ("completion not text", {"prompt": "q", "completion": 5}, "'completion' is a int, not text"),
    ("messages not a list", {"messages": "hi"}, "'messages' is not a non-empty list"),
    ("no messages", {"messages": []}, "'messages' is not a non-empty list"),
    ("a message without a role", {"messages": [{"content": "x"}]}, "messages[0] is not an object"),
    ("a role not text", {"messages": [{"role": 1, "content": "x"}]}, "must be text"),
    ("no assistant", {"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
    (
        "a role the template does not know",
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
        "role 'robot' is not one the chat template of tokenizer knows "
        "(assistant, system, tool, user)",
    ),
    (
        "an empty assistant turn",
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]},
        "messages[1]: an empty assistant turn",
    ),
    ("an empty completion", {"prompt": "q", "completion": ""}, "an empty 'completion'"),
    (
        "nothing counted after the cut",
        {
            "messages": [
                {"role": "user", "content": "x" * 300},
                {"role": "assistant", "content": "y"},
            ]
        },
        "no token counts as a target after the cut to --seq-len 128",
    ),
]


@pytest.mark.parametrize(("name", "record", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_instruction_data_is_named_by_line_and_nothing_is_left(
    tmp_path, capsys, tokenizer, name, record, message
):
    good = {"messages": CHAT[1:3]}
    src = write_jsonl(tmp_path / "data.jsonl", [good, good, record])
    out = tmp_path / "out"
    argv = ["data", "prepare", str(src), "--instruct", "--tokenizer", str(tokenizer)]
    code = main([*argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "data.jsonl, line 3: " in err and message in err, err
    assert "Fix:" in err and "Traceback" not in err, err
    assert not out.exists() and not list(tmp_path.glob(".out*")), "nothing half-written"


def test_a_file_that_is_not_utf8_or_nests_too_deep_is_named(tmp_path, capsys, tokenizer):
    for name, content, message in (
        ("latin.jsonl", b'{"prompt": "a", "completion": "b"}\n{"prompt": "\xe9"}\n',
         "latin.jsonl, line 2: not UTF-8 text"),
        ("deep.jsonl", b"[" * 100_000 + b"\n", "deep.jsonl, line 1: not JSON"),
    ):  # fmt: skip
        (tmp_path / name).write_bytes(content)
        out = tmp_path / f"out-{name}"
        code = main(["data", "prepare", str(tmp_path / name), "--instruct", "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Fix:" in err and "Traceback" not in err, err
        assert not out.exists()


def test_a_template_that_drops_a_role_silently_is_refused(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    # renders user and assistant, drops any other role without a word
    tok.chat_template = CHAT_TEMPLATE.replace(
        "{{ raise_exception('unknown role ' + m['role']) }}", ""
    ).replace("<|{{ m['role'] }}|>{{ m['content'] }}<|end|>",
              "{% if m['role'] in ['user', 'assistant'] %}<|{{ m['role'] }}|>"
              "{{ m['content'] }}<|end|>{% endif %}")  # fmt: skip
    tok.save_pretrained(str(tmp_path / "dropping"))
    src = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError, match=r"line 1: messages\[0\]: .* does not render role 'system'"):
        prepare_instructions(
            [str(src)], str(tmp_path / "o"), tokenizer=str(tmp_path / "dropping"), progress=quiet
        )


def test_a_tokenizer_without_a_template_or_config_is_named(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT[1:3]}])
    with pytest.raises(DataError, match="line 1: chat messages need a chat template"):
        prepare_instructions([str(src)], str(tmp_path / "o"), progress=quiet)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no tokenizer_config.json"):
        prepare_instructions(
            [str(src)], str(tmp_path / "o"), tokenizer=str(tmp_path / "empty"), progress=quiet
        )


def test_flags_of_the_other_kind_of_input_are_refused(tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "a", "completion": "b"}])
    assert main(["data", "prepare", str(src), "--out", str(tmp_path / "o"), "--pack"]) == 2
    assert "--pack: only with --instruct" in capsys.readouterr().err
    code = main(["data", "prepare", str(src), "--out", str(tmp_path / "o"), "--instruct",
                 "--shuffle"])  # fmt: skip
    assert code == 2 and "--shuffle: only without --instruct" in capsys.readouterr().err


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=8),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(
                    st.sampled_from(["prompt", "completion", "messages", "role", "content", "x"]),
                    inner,
                    max_size=4,
                )
            ),
            max_leaves=12,
        ),
        min_size=1,
        max_size=4,
    )
)
def test_any_json_lines_give_rows_or_a_named_error(tmp_path_factory, tokenizer, records):
    """Untrusted lines: a value of any JSON shape where an example is expected gives rows or a
    DataError naming the file and line, never another exception."""
    folder = tmp_path_factory.mktemp("fuzz")
    src = write_jsonl(folder / "f.jsonl", [json.dumps(r) for r in records])
    try:
        prepare_instructions(
            [str(src)], str(folder / "o"), tokenizer=str(tokenizer), progress=quiet
        )
    except DataError as exc:
        assert "f.jsonl" in str(exc), exc


def _parquet(path: Path, tokens, masks, mask_type=None) -> str:
    pq.write_table(
        pa.table(
            {
                "tokens": pa.array(tokens, pa.list_(pa.int64())),
                "loss_mask": pa.array(masks, pa.list_(mask_type or pa.uint8())),
            }
        ),
        path,
    )
    return str(path)


@pytest.mark.parametrize(
    ("column", "values", "message"),
    [
        ("loss_mask", [[0, 1, 1], [0, 1]], "row 1: `loss_mask` has 2 entries for 3 tokens"),
        ("loss_mask", [[0, 1, 1], [0, 2, 1]], "row 1: `loss_mask` holds 2, not 0 or 1"),
        ("loss_mask", [[0, 1, 1], None], "row 1: `loss_mask` is null"),
        ("documents", [[0, 0, 1], [0, 1]], "row 1: `documents` has 2 entries for 3 tokens"),
        ("documents", [[0, 0, 1], [0, 1, 0]], "row 1: `documents` numbers go back or below 0"),
        ("documents", [[0, 0, 1], [0, -1, 0]], "row 1: `documents` numbers go back or below 0"),
    ],
)
def test_a_column_beside_the_tokens_that_does_not_fit_them_is_named_by_row(
    tmp_path, column, values, message
):
    columns = {"tokens": pa.array([[1, 2, 3], [4, 5, 6]], pa.list_(pa.int64()))}
    columns[column] = pa.array(
        values, pa.list_(pa.int16() if column == "documents" else pa.uint8())
    )
    pq.write_table(pa.table(columns), tmp_path / "m.parquet")
    with pytest.raises(DataError, match=re.escape(message)):
        describe_dataset(str(tmp_path / "m.parquet"))


def test_taken_rows_ignore_the_targets_the_mask_does_not_count(tmp_path):
    """Equal-length rows (one tensor) and rows of varying length (padded per micro-batch)
    alike; a boolean mask as a 0/1 one."""
    from rayacc.data.rows import read_local_rows
    from rayacc.data.sources import read_source

    for tokens, masks, kind in (
        ([[1, 2, 3, 4], [5, 6, 7, 8]], [[0, 0, 1, 1], [0, 1, 0, 1]], pa.uint8()),
        ([[1, 2, 3, 4], [5, 6]], [[False, False, True, True], [False, True]], pa.bool_()),
    ):
        source = read_source(_parquet(tmp_path / f"{len(tokens[1])}.parquet", tokens, masks, kind))
        assert source.info.loss_mask
        local = read_local_rows(source.info, source.groups, np.arange(2))
        batch = local.take(np.arange(2))
        for i, (t, m) in enumerate(zip(tokens, masks, strict=True)):
            want = [x if c else IGNORE_INDEX for x, c in zip(t[1:], m[1:], strict=True)]
            got = batch["target"][i, : len(want)].tolist()
            assert got == want, (got, want)
            assert (batch["target"][i, len(want) :] == IGNORE_INDEX).all()
    assert isinstance(local, LocalRows) and torch.is_tensor(batch["input"])


def test_packed_rows_reach_the_model_as_documents_or_are_refused_before_launch(tmp_path, tokenizer):
    """Taken rows carry each input position's example (padding an example of its own); a
    model whose forward takes no `documents` is refused before anything starts."""
    from rayacc.config import TrainConfig
    from rayacc.data.rows import read_local_rows
    from rayacc.data.sources import read_source
    from rayacc.driver.prelaunch import prepare
    from rayacc.models import ModelError

    src = write_jsonl(tmp_path / "p.jsonl", [{"messages": CHAT[1:3]}] * 6 + [{"messages": CHAT}])
    out = tmp_path / "packed"
    prepare_instructions(
        [str(src)], str(out), seq_len=60, tokenizer=str(tokenizer), pack=True, progress=quiet
    )
    source = read_source(str(out))
    local = read_local_rows(source.info, source.groups, np.arange(source.info.num_rows))
    batch = local.take(np.arange(source.info.num_rows))
    table = rows(out)
    for i, r in enumerate(table):
        n = len(r["documents"]) - 1
        assert batch["documents"][i, :n].tolist() == r["documents"][:-1]
        assert (batch["documents"][i, n:] == -1).all()
    base = {"data": {"source": str(out), "val_fraction": 0.0, "seq_len": 60},
            "batch": {"global_batch_size": 2, "micro_batch_size": 1},
            "scaling": {"num_workers": 1}, "tracking": {"enabled": False}}  # fmt: skip
    gpt = {"name": "gpt", "n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 64}
    assert prepare(TrainConfig.from_dict({**base, "model": gpt})).info.documents
    plain = {"name": "factory", "factory": "tests.support.models.plain_token_model:build"}
    with pytest.raises(ModelError, match="takes no `documents`.*Fix: prepare the data without"):
        prepare(TrainConfig.from_dict({**base, "model": plain}))
    # a pipeline's stages send activations of one shape, no example's mask: refused by name
    # before launch (its first window failed, exit 1, after the workers started)
    piped = {**base, "model": {**gpt, "n_layer": 2},
             "scaling": {"num_workers": 2, "cpus_per_worker": 0.5},
             "train": {"strategy": "fsdp", "pipeline_parallel": 2}}  # fmt: skip
    with pytest.raises(ConfigError) as error:
        prepare(TrainConfig.from_dict(piped))
    text = str(error.value)
    assert "data.source: holds packed rows" in text and "train.pipeline_parallel=2" in text, text
    assert "Fix: prepare the data without --pack, or train.pipeline_parallel=1" in text
    assert str(out) in text


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A template that renders any role (ChatML's usual form): it refuses none by itself."""


def test_roles_are_the_templates_and_an_empty_answer_is_refused_or_skipped(tmp_path, tokenizer):
    """A template that renders any role still knows only the field's roles and those it names:
    `bot` beside an assistant turn, or as the only answer, is named with its line; an empty
    assistant turn is refused, or skipped with --skip-empty and counted."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    tok.chat_template = CHATML.replace("{% for", "{% if messages[0]['role'] == 'ipython' %}"
                                       "{% endif %}{% for")  # fmt: skip
    tok.save_pretrained(str(tmp_path / "chatml"))
    user, answer = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
    for name, messages in (("beside", [user, {"role": "bot", "content": "x"}, answer]),
                           ("alone", [user, {"role": "bot", "content": "x"}])):  # fmt: skip
        src = write_jsonl(tmp_path / f"{name}.jsonl", [{"messages": [user, answer]},
                                                       {"messages": messages}])  # fmt: skip
        with pytest.raises(DataError) as error:
            prepare_instructions([str(src)], str(tmp_path / f"o-{name}"),
                                 tokenizer=str(tmp_path / "chatml"), progress=quiet)  # fmt: skip
        text = str(error.value)
        assert f"{name}.jsonl, line 2: messages[1]: role 'bot' is not one" in text, text
        assert "(assistant, ipython, system, tool, user)" in text, text  # the one it names
    empty = [user, {"role": "assistant", "content": ""}]
    src = write_jsonl(tmp_path / "e.jsonl", [{"messages": [user, answer]}, {"messages": empty}])
    with pytest.raises(DataError, match=r"e.jsonl, line 2: messages\[1\]: an empty assistant"):
        prepare_instructions([str(src)], str(tmp_path / "o-e"),
                             tokenizer=str(tmp_path / "chatml"), progress=quiet)  # fmt: skip
    said = []
    done = prepare_instructions(
        [str(src)], str(tmp_path / "o-skip"), skip_empty=True,
        tokenizer=str(tmp_path / "chatml"), progress=said.append,
    )  # fmt: skip
    assert (done.examples, done.skipped) == (1, 1) and "1 skipped" in said[-1], said


@pytest.mark.parametrize("column", ["loss_mask", "documents"])
def test_a_prepared_folder_with_a_part_lacking_a_column_is_named_before_launch(
    tmp_path, tokenizer, column
):
    """A folder whose first part holds `loss_mask` (or `documents`) and another part not:
    it ended in pyarrow's traceback at the first read, exit 1; every part's columns are
    checked as the first's are."""
    src = write_jsonl(tmp_path / "p.jsonl", [{"messages": CHAT[1:3]}] * 6)
    out = tmp_path / "packed"
    prepare_instructions([str(src)], str(out), seq_len=60, tokenizer=str(tokenizer),
                         pack=True, progress=quiet)  # fmt: skip
    first = sorted(out.glob("*.parquet"))[0]
    table = pq.read_table(first)
    pq.write_table(table.drop_columns([column]), out / "zz-odd.parquet")
    code = main(["plan", "-c", "jobs/digits.yaml", f"data.source={out}", "model.name=gpt",
                 "--memory"])  # fmt: skip
    assert code == 2
    with pytest.raises(DataError) as error:
        describe_dataset(str(out))
    text = str(error.value)
    assert "zz-odd.parquet" in text and f"no column {column}" in text and "Fix:" in text, text
