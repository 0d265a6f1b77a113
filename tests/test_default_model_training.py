"""The embedded model's training script (service/default_model/train_default.py) runs end to end on the CPU, on a
slice of its corpus, with repeated fortunes in its data: what it writes loads into the engine and generates."""
import json

from service.default_model.train_default import main


def test_the_training_script_runs_on_the_cpu(tmp_path):
    main(["--device", "cpu", "--fortunes", "300", "--steps", "3", "--tokens-per-step", "512", "--repeat-share",
          "0.5", "--out", str(tmp_path)])
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert log["steps"] == 3 and len(log["val_loss"]) == len(log["val_copy_loss"]) == 1
    assert 0 < log["val_copy_loss"][0] < 20 and all(isinstance(text, str) for text in log["samples"].values())
    assert log["json_object"]["finish_reason"] and log["json_object"]["text"].startswith("{")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "loss_curve.png"):
        assert (tmp_path / name).is_file()
