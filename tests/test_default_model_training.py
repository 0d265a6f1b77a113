"""The embedded model's training script (service/default_model/train_default.py) runs end to end on the CPU, on a
slice of its corpus, with repeated fortunes and fortunes as JSON in its data: what it writes loads into the engine and
generates."""
import json
import random
from pathlib import Path
from types import SimpleNamespace

from service.default_model.train_default import as_json, batches, main


def test_the_training_script_runs_on_the_cpu(tmp_path):
    main(["--device", "cpu", "--fortunes", "300", "--steps", "3", "--tokens-per-step", "512", "--repeat-share",
          "0.4", "--json-share", "0.3", "--out", str(tmp_path)])
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert log["steps"] == 3 and len(log["val_loss"]) == len(log["val_copy_loss"]) == 1
    assert 0 < log["val_copy_loss"][0] < 20 and all(isinstance(text, str) for text in log["samples"].values())
    assert log["json_object"]["finish_reason"] and log["json_object"]["text"].startswith("{")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "loss_curve.png"):
        assert (tmp_path / name).is_file()


def test_training_goes_on_from_the_shipped_weights_with_their_tokenizer(tmp_path):
    """--init: the shipped weights and tokenizer are where training starts (held-out loss near theirs, ~4.3 nats a
    token; from random weights it starts near ln 4096 = 8.3)."""
    shipped = Path(__file__).resolve().parents[1] / "service" / "default_model"
    main(["--device", "cpu", "--fortunes", "300", "--steps", "1", "--tokens-per-step", "512", "--lr", "1e-9",
          "--repeat-share", "0.5", "--init", str(shipped), "--out", str(tmp_path)])
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert log["val_loss"][0] < 6 and log["json_object"]["finish_reason"]
    assert (tmp_path / "tokenizer.json").read_text() == (shipped / "tokenizer.json").read_text()


def test_the_data_mix_draws_each_pool_at_its_share_and_nothing_without_one():
    examples, copies, jsons = ([SimpleNamespace(token_ids=[0], pool=name)] for name in ("text", "copy", "json"))
    drawn = [ex.pool for _, batch in zip(range(4000), batches(examples, 1, random.Random(0), [(copies, 0.2),
                                                                                           (jsons, 0.1)]))
             for ex in batch]
    assert abs(drawn.count("copy") / 4000 - 0.2) < 0.03 and abs(drawn.count("json") / 4000 - 0.1) < 0.03
    # Without a mix the examples come as the shipped weights saw them: one randrange a draw, nothing else.
    many = [SimpleNamespace(token_ids=[0], pool=i) for i in range(50)]
    rng, want = random.Random(1), random.Random(1)
    assert [b[0].pool for _, b in zip(range(20), batches(many, 1, rng))] == [want.randrange(50) for _ in range(20)]


def test_a_fortune_as_json_keeps_its_words_and_its_attribution():
    said = json.loads(as_json('Fraud is the homage.\n\t\t-- Charles Curtis, "A Book"')["text"])
    assert said == {"quote": "Fraud is the homage.", "by": 'Charles Curtis, "A Book"'}
    assert json.loads(as_json("No one\nsaid this")["text"]) == {"quote": "No one\nsaid this"}
