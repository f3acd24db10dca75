"""The corpus: byte vocabulary round trip, the stdlib default is real text, packing is position-stable."""

import json

import pytest
import torch

from ds_ulysses.train.corpus import ByteVocab, PackedSamples, file_texts, load_tokenizer, stdlib_texts


@pytest.mark.parametrize("text", ["def f(x):\n    return x + 1\n", "naïve café — 東京 🚀", "", "\x00\xff"])
def test_byte_vocab_round_trips(text):
    vocab = ByteVocab()
    ids = vocab.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert vocab.decode(ids) == text
    assert vocab.decode([vocab.bos_id, *ids, vocab.eos_id, vocab.pad_id]) == text  # specials dropped


def test_byte_vocab_layout():
    vocab = ByteVocab()
    assert vocab.vocab_size == 260
    assert {vocab.pad_id, vocab.bos_id, vocab.eos_id, vocab.unk_id} == {256, 257, 258, 259}
    assert vocab.decode(vocab.encode("é")[:1]) == "\ufffd"  # a cut multi-byte character does not raise


def test_stdlib_default_is_real_python_source_in_sorted_order():
    docs = []
    for text in stdlib_texts():
        docs.append(text)
        if len(docs) == 20:
            break
    assert len(docs) == 20
    joined = "".join(docs)
    assert "import " in joined and "def " in joined
    printable = sum(c.isprintable() or c in "\n\t" for c in joined) / len(joined)
    assert printable > 0.99
    again = [t for t, _ in zip(stdlib_texts(), range(20))]
    assert again == docs  # deterministic


def test_stdlib_walk_is_sorted_and_skips_installed_packages_and_non_utf8(tmp_path):
    for rel, body in [("b.py", "b"), ("a.py", "a"), ("pkg/z.py", "z"), ("pkg/c.txt", "not python"),
                      ("site-packages/numpy.py", "installed"), ("__pycache__/x.py", "cache"), ("ab/m.py", "m")]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(body)
    (tmp_path / "bad.py").write_bytes(b"\xff\xfe latin-1 fixture")
    assert list(stdlib_texts(tmp_path)) == ["a", "b", "m", "z"]


def test_packed_samples_are_text_windows_independent_of_their_count():
    vocab = ByteVocab()
    many = PackedSamples(stdlib_texts, vocab, 512, 6)
    few = PackedSamples(stdlib_texts, vocab, 512, 3)
    for i in range(3):
        assert torch.equal(many[i]["input_ids"], few[i]["input_ids"])
    sample = many[2]
    assert sample["input_ids"].shape == (512,) and torch.equal(sample["input_ids"], sample["labels"])
    assert torch.equal(many.subset(2)[0]["input_ids"], many[2]["input_ids"])
    assert len(many.subset(2)) == 4 and len(many.subset(1, 2)) == 2
    text = vocab.decode(many[0]["input_ids"].tolist())
    assert len(text) > 400 and ("import" in text or "def" in text or '"""' in text)


def test_short_data_wraps_and_jsonl_text_fields(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "xy"}) + "\n\n" + json.dumps({"text": "z"}) + "\n")
    paths = [tmp_path / "a.txt", tmp_path / "b.jsonl"]
    assert list(file_texts(paths)) == ["abc", "xy", "z"]
    vocab = ByteVocab()
    samples = PackedSamples(lambda: file_texts(paths), vocab, 5, 3)
    eos = vocab.eos_id
    stream = [97, 98, 99, eos, 120, 121, eos, 122, eos]
    expect = (stream * 2)[:15]
    assert torch.cat([samples[i]["input_ids"] for i in range(3)]).tolist() == expect


def test_bad_inputs_say_what_and_how_to_fix(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"content": "x"}) + "\n")
    expected = r"bad.jsonl:1: expected an object with a string \"text\" field, got \['content'\]"
    with pytest.raises(ValueError, match=expected):
        list(file_texts([bad]))
    with pytest.raises(FileNotFoundError, match="no such file"):
        list(file_texts([tmp_path / "missing.txt"]))
    with pytest.raises(FileNotFoundError, match="expected a local HF tokenizer directory"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(ValueError, match="fix: pass --data files that contain text"):
        PackedSamples(lambda: iter(()), ByteVocab(), 8, 1)[0]
    with pytest.raises(ValueError, match="at least 2 tokens"):
        PackedSamples(stdlib_texts, ByteVocab(), 1, 1)


def test_local_hf_tokenizer_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"[UNK]": 0, "<eos>": 1, "hello": 2, "world": 3}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="[UNK]").save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.source) == (4, 1, 1, str(tmp_path))
    assert tok.encode("hello world hello") == [2, 3, 2]
    samples = PackedSamples(lambda: iter(["hello world", "world"]), tok, 3, 2)
    assert [samples[i]["input_ids"].tolist() for i in range(2)] == [[2, 3, 1], [3, 1, 2]]
