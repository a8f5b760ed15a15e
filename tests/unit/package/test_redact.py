"""The one credential matcher (rayacc/redact.py): every shape a credential takes is masked
(a table of shapes, and a property test that plants a secret in random text), in time linear
in the input; the console boundary masks whole lines, however they are written; rayacc's
consoles print user text as given (no markup, no highlighting)."""

from __future__ import annotations

import io
import string
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayacc.driver.jobs import job_command
from rayacc.observe.console import QuietRayStream, make_console, styled
from rayacc.redact import RedactingStream, contains_secret, redact

SHAPES = [
    # passwords holding quotes, angle brackets or spaces (unescaped, as users paste them)
    ('postgresql://u:pa"ss@db:5432/x', "postgresql://***@db:5432/x"),
    ("postgresql://u:pa'ss@db:5432/x", "postgresql://***@db:5432/x"),
    ("mysql://u:p<a>ss@db/x", "mysql://***@db/x"),
    ("http://u:pa ss word@host:5000/api", "http://***@host:5000/api"),
    ("'http://u:p\"a ss@host' rest", "'http://***@host' rest"),
    # a scheme right after a digit or another scheme character
    ("1http://u:pw@host/x", "1http://***@host/x"),
    ("x.https://u:pw@host/x", "x.https://***@host/x"),
    # tokens in a fragment (OAuth implicit flow) and under more key names
    ("https://app/cb#access_token=t0k&state=1", "https://app/cb#access_token=***&state=1"),
    ("https://h/x?aws_secret_access_key=ab/c+d&x=1", "https://h/x?aws_secret_access_key=***&x=1"),
    ("https://h/x?AWS_ACCESS_KEY_ID=AKIA1&x=1", "https://h/x?AWS_ACCESS_KEY_ID=***&x=1"),
    ("https://gitlab/api?private_token=glpat-1", "https://gitlab/api?private_token=***"),
    ("https://h/x?access_key=k&y=2", "https://h/x?access_key=***&y=2"),
    ("https://h/x?credential=c", "https://h/x?credential=***"),
    ("https://h/x?api-key=k", "https://h/x?api-key=***"),
    ("https://h/x?auth=a1;b=2", "https://h/x?auth=***;b=2"),
    ("https://h/x?pwd=p&user=u", "https://h/x?pwd=***&user=u"),
    # keyed values: libpq strings, environment lines, JSON and Python mappings, YAML, headers
    ("host=db user=u password=pw0 dbname=x", "host=db user=u password=*** dbname=x"),
    ("host=db password='a b c' port=5", "host=db password='***' port=5"),
    ("AWS_SECRET_ACCESS_KEY=wJalr/K7+MDENG", "AWS_SECRET_ACCESS_KEY=***"),
    ("export MLFLOW_TRACKING_PASSWORD=pw", "export MLFLOW_TRACKING_PASSWORD=***"),
    ("HF_TOKEN=abc python x.py", "HF_TOKEN=*** python x.py"),
    ('{"api_key": "k\\"1", "n": 2}', '{"api_key": "***", "n": 2}'),
    ("{'client_secret': 'c'}", "{'client_secret': '***'}"),
    ("db_password: hunter2", "db_password: ***"),
    ("Authorization: Bearer eyJ0.eyJ1.sig-_x", "Authorization: Bearer ***"),
    ("-H 'Authorization: Basic dXNlcjpw' x", "-H 'Authorization: Basic ***' x"),
    ("sent Bearer abc123ghij.klmnopqr==", "sent Bearer ***"),
    ("bearer tokens are short-lived", None),
    ("bearer loss_chunk_tokens=8192", None),
    # a command line's secret flags
    ("mysql --user u --password hunter2 db", "mysql --user u --password *** db"),
    ("run --db-password=hunter2 --x 1", "run --db-password=*** --x 1"),
    ("cli --api-key 'k e y' go", "cli --api-key '***' go"),
    # the well-known token formats, wherever they stand
    ("use ghp_" + "a1" * 18 + " now", "use *** now"),
    ("github_pat_" + "A_1" * 10, "***"),
    ("(hf_" + "Xy" * 17 + ")", "(***)"),
    ("glpat-" + "z" * 20, "***"),
    ("key sk-proj-" + "Q" * 40, "key ***"),
    ("xoxb-1234-5678-abcdefghij", "***"),
    ("AKIAIOSFODNN7EXAMPLE wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY end", "*** end"),
    ("id ASIAIOSFODNN7EXAMPLE,", "id ***,"),
    # not credentials: left as they are
    ("loss_chunk_tokens=8192 --tokens 200 tokenizer=t.json", None),
    ("rayacc: 200 tokens from x; keyboard: yes; author=a", None),
    ("the passage: 3, secretary=no, --monkey 2, task-aaaaaaaaaaaaaaaaaaaaaaaa", None),
    ("  - train.loss_chunk_token: unknown key. Fix: did you mean", None),
    ("model.kwargs.token=abc and x.password = p", "model.kwargs.token=*** and x.password = ***"),
    ("sqlite:////tmp/mlflow.db", "sqlite:////tmp/mlflow.db"),
    ("https://h/x?author=a&keyboard=k&monkey=1", "https://h/x?author=a&keyboard=k&monkey=1"),
    ("mail me@x.org, see https://h/x", "mail me@x.org, see https://h/x"),
    ("http://h/x\nuser@host", "http://h/x\nuser@host"),
]


@pytest.mark.parametrize(("text", "masked"), SHAPES)
def test_every_shape_of_a_credential_is_masked(text, masked):
    masked = text if masked is None else masked
    assert redact(text) == masked
    assert contains_secret(text) == (text != masked)


SECRET = st.text(
    alphabet=st.characters(codec="utf-8", exclude_characters="\n\r\x00"), min_size=1, max_size=30
).filter(lambda s: "://" not in s)
AROUND = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=60)
QUERY_SECRET = st.text(
    alphabet=st.characters(
        codec="utf-8", exclude_characters="&;#'\"<>\x00", exclude_categories=("Z", "C")
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(before=AROUND, secret=SECRET, after=AROUND, scheme=st.sampled_from(["http", "s3", "gs"]))
def test_a_password_in_a_uri_never_survives_in_any_surrounding_text(before, secret, after, scheme):
    planted = "Zq9" + secret  # distinct from the text around it
    text = f"{before} {scheme}://user:{planted}@host/p {after}"
    assert planted not in redact(text)
    assert contains_secret(text)


@settings(max_examples=300, deadline=None)
@given(
    before=AROUND,
    secret=QUERY_SECRET,
    after=AROUND,
    key=st.sampled_from(["token", "X-Amz-Signature", "aws_secret_access_key", "api-key", "sig"]),
    lead=st.sampled_from(["?", "&", "#", ";"]),
)
def test_a_token_in_a_query_never_survives_in_any_surrounding_text(
    before, secret, after, key, lead
):
    planted = "Zq9" + secret
    text = f"{before} https://h/x{lead}{key}={planted}&a=1 {after}"
    assert planted not in redact(text)


ALNUM = st.text(alphabet=string.ascii_letters + string.digits, min_size=1)
BARE = st.text(
    alphabet=st.characters(
        codec="utf-8", exclude_characters="&;,'\"<>(){}[]\x00", exclude_categories=("Z", "C")
    ),
    min_size=1,
    max_size=30,
)
QUOTED = st.text(
    alphabet=st.characters(codec="utf-8", exclude_characters='"\\\n\r\x00'), max_size=30
)

# every keyed and token shape the matcher knows: (the text to plant, the secret in it)
PLANTED = {
    "libpq": BARE.map(lambda s: (f"host=db password=Zq9{s} dbname=x", f"Zq9{s}")),
    "libpq quoted": QUOTED.filter(lambda s: "'" not in s).map(
        lambda s: (f"password='Zq9{s}' port=5", f"Zq9{s}")
    ),
    "environment": BARE.map(lambda s: (f"AWS_SECRET_ACCESS_KEY=Zq9{s}", f"Zq9{s}")),
    "json": QUOTED.map(lambda s: (f'{{"api_key": "Zq9{s}", "n": 1}}', f"Zq9{s}")),
    "yaml": BARE.map(lambda s: (f"mlflow_tracking_token: Zq9{s}", f"Zq9{s}")),
    "header": BARE.map(lambda s: (f"Authorization: Bearer Zq9{s}", f"Zq9{s}")),
    "flag": BARE.map(lambda s: (f"tool --password Zq9{s} --x 1", f"Zq9{s}")),
    "flag=": BARE.map(lambda s: (f"tool --db-password=Zq9{s}", f"Zq9{s}")),
    "github": ALNUM.map(lambda s: (f"ghp_Zq9{s:0<33}", f"Zq9{s:0<33}")),
    "hugging face": ALNUM.map(lambda s: (f"hf_Zq9{s:0<31}", f"Zq9{s:0<31}")),
    "aws key pair": st.tuples(ALNUM, ALNUM).map(
        lambda p: (f"AKIA{p[0][:13].upper():0<13}ZQ9 {p[1][:37]:0<37}Zq9", f"{p[1][:37]:0<37}Zq9")
    ),
}


@settings(max_examples=60, deadline=None)
@given(before=AROUND, after=AROUND, planted=st.one_of(*PLANTED.values()))
def test_a_secret_in_any_keyed_or_token_shape_never_survives(before, after, planted):
    shape, secret = planted
    text = f"{before} {shape} {after}"
    assert secret not in redact(text), text
    assert contains_secret(text)


@pytest.mark.parametrize("shape", PLANTED)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_each_shape_is_masked_in_random_text(shape, data):
    """The property above, drawn for each shape in turn (one_of may favour a few)."""
    text, secret = data.draw(PLANTED[shape])
    before, after = data.draw(AROUND), data.draw(AROUND)
    assert secret not in redact(f"{before} {text} {after}")


BENIGN = st.sampled_from(
    [
        "step 3",
        "loss 2.31",
        "rayacc: 200 tokens from run-1",
        "loss_chunk_tokens=8192",
        "n_tokens=5",
        "tokenizer=tokenizer.json",
        "--tokens 200",
        "--top-k 3",
        "--seq-len 128",
        "batch.micro_batch_size=8",
        "train.max_steps=3",
        "keyboard: yes",
        "author=a",
        "the passage: 3",
        "secretary=no",
        "monkey=1",
        "https://h/x?page=2&user=a",
        "s3://bucket/data/part-0.parquet",
        "sqlite:////tmp/mlflow.db",
        "/tmp/a-b/c_d.txt",
        # (an `@` after a URI on one line masks the URI: more than it must, by design, never less)
        "ghp_short",
        "hf_hub",
        "AKIA",
        "bearer",
        "key",
        "password",
        "(x)",
    ]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(BENIGN, st.sampled_from([" ", ", ", "\n", "; ", " | "])), max_size=12))
def test_text_without_a_secret_is_left_as_it_is(pieces):
    text = "".join(piece + sep for piece, sep in pieces)
    assert redact(text) == text
    assert not contains_secret(text)


ADVERSARIAL = {
    "a.a.a.": "a." * (1 << 19),
    "a.a.a.://": "a." * (1 << 19) + "://",
    "a://": "a://" * (1 << 18),
    "a:/": "a:/" * 349_525,
    "????": "?" * (1 << 20),
    "?a=": "?a=" * 349_525,
    "a://@": "a://@" * 209_715,
    "aaaa://": "a" * (1 << 20) + "://",
    "http://" + "@" * 8: "http://" + "@" * (1 << 20),
    "password=x ": "password=x " * 95_325,
    "a-a-…-token": "a-" * (1 << 19) + "token",
    "--token ": "--token " * (1 << 17),
    "Bearer ": "Bearer " * 149_796,
    "ghp_": "ghp_" * (1 << 18),
    "a_a_…_token": "a_" * (1 << 19) + "token",
    "a.a.…token:": "a." * (1 << 19) + "token:",
    "AKIA… ": ("AKIA" + "A" * 16 + " ") * 49_932,
}


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_the_matcher_takes_linear_time_on_adversarial_input(name):
    """A quadratic matcher takes minutes on 1 MB of these; the bound holds on any machine (the
    figures: bench/redact_speed.py)."""
    text = ADVERSARIAL[name]
    t0 = time.perf_counter()
    redact(text)
    contains_secret(text)
    assert time.perf_counter() - t0 < 10, name


def test_a_uri_written_in_pieces_is_masked_as_one_line():
    out = io.StringIO()
    stream = RedactingStream(out)
    for piece in ("tracking at http://alice:", "s3cr", "et@mlflow:5000", " ok\nnext "):
        stream.write(piece)
    assert out.getvalue() == "tracking at http://***@mlflow:5000 ok\n"
    stream.write("http://bob:")
    stream.flush()  # a flush does not let half a line out
    assert "bob" not in out.getvalue()
    stream.write("pw@h\rprogress 1/2\r")
    assert out.getvalue().endswith("next http://***@h\rprogress 1/2\r")
    stream.write("tail http://c:d")
    stream.release()
    assert out.getvalue().endswith("tail http://c:d")  # no `@`: nothing to mask


def test_the_quiet_stream_still_drops_rays_records_and_masks_the_rest():
    out = io.StringIO()
    stream = QuietRayStream(out)
    stream.write("2026-12-02 10:00:00,123\tINFO worker.py:1 -- Started\n  more of it\n")
    stream.write("rayacc: see http://u:")
    stream.write("p@h\n")
    assert out.getvalue() == "rayacc: see http://***@h\n"


@pytest.mark.parametrize(
    "override",
    [
        "tracking.tracking_uri=postgresql://u:pa ss@db/x",
        "data.source=https://h/d.parquet#access_token=t0k",
        "data.source=https://h/d.parquet?aws_secret_access_key=k",
        "data.source=https://h/d.parquet?private_token=k",
    ],
)
def test_submit_moves_every_override_the_matcher_finds_a_credential_in(override, tmp_path):
    entrypoint, env = job_command(tmp_path / "job.yaml", [override, "train.max_steps=3"])
    assert override not in entrypoint and "train.max_steps=3" in entrypoint
    assert override in env["RAYACC_OVERRIDES"]


def test_user_text_is_printed_as_given_and_never_split_by_a_highlighter():
    out = io.StringIO()
    console = make_console(file=out, force_terminal=True, width=200)
    path = "/mnt/team[ml]/runs/x[/a]/checkpoint_step00000012"
    console.print(f"  sample it: rayacc sample {path}")
    console.print(styled(("rayacc: ", "red"), "[rank1]: failed at http://u:p@h:5000/x"))
    text = out.getvalue()
    assert f"rayacc sample {path}" in text
    assert "[rank1]: failed at http://u:p@h:5000/x" in text  # whole: the boundary can mask it
    assert redact(text).count("http://***@h:5000/x") == 1
