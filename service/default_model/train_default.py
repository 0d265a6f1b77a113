"""Trains the embedded default model: a 7.2M-parameter Llama (13.8 MiB of bf16 weights) with its own byte-level BPE
tokenizer (4096 tokens), from random init, on Debian's fortune cookie files, through the fine-tuning path of
the service (packed varlen batches, our Triton attention forward + backward kernels on the GPU, fp32 master
weights with bf16 autocast, AdamW).

    python -m service.default_model.train_default --prepare-corpus   # once, where `apt-get install fortunes`
    python -m service.default_model.train_default [--out DIR]        # on the GPU (training budget 240 s, ~5 min in all)
    python -m service.default_model.train_default --device cpu --fortunes 300 --steps 3 --out DIR  # a smoke (CI)

Corpus recipe (--prepare-corpus): every text file of /usr/share/games/fortunes (Debian packages fortunes-min and
fortunes, DFSG-free, BSD-style licence; the offensive set lives elsewhere and is not read, and the
`ethnic` and `men-women` files are skipped), split into fortunes at the `%` lines,
whitespace trimmed, only printable ASCII kept, deduplicated, shuffled with seed 0, one fortune per record
separated by `%` lines, gzipped into corpus.txt.gz beside this script (~1 MB), so the GPU machine needs
no package. Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json, loss_curve.png, training_log.json (losses, settings, samples, and a greedy answer under a
JSON-object grammar with how it ended) to --out.

--repeat-share S (default 0, the shipped weights): a share S of the training examples are a training fortune said
once or twice, each time followed by a `%` line, as a prompt, and said again as the completion; the loss counts
only that last saying. A model that never sees a passage twice learns no copying, and n-gram speculative decoding
(benchmarks/spec.py's copy-heavy prompts: a fortune, again, then its start) gains only where the model repeats its
context. Since no loss falls on what follows a fortune's first saying, the model does not learn to start a fortune
over once it has ended it (a first version, the whole repeated text as one example, made it write `%` and say the
fortune again where it should have stopped). The held-out log then also holds the loss of a held-out fortune's
second saying (val_copy_loss: near zero once the model copies). Not the shipped weights: with S = 0.25 (1500 steps,
an H200, 5583351) the model copied (second saying 0.19 nats/token) and n-gram speculation ran a copy-heavy single
stream 2.88x faster, but greedy decoding under a JSON grammar copied its own output until max_tokens (a key and
value said over and over, where the model trained without copies closes `{}`). Tried on the same H200 (ad77807,
since removed): other fortunes said among the first sayings and a share of the records ending in a new fortune, so
that the model copies only a passage whose start repeats; at shares 0.12-0.25 with a quarter or half of them new,
1500 or 3000 steps, none of five variants learned to copy (second saying 4.2-5.7 nats/token; two of them looped
under the JSON grammar all the same), and S = 0.1 of plain copies neither copied (4.7) nor stayed out of the loop.

--json-share J (default 0, the shipped weights): a share J of the training examples are a fortune as a JSON object,
`{"quote": "...", "by": "..."}` (the attribution where the fortune has one), so that the model learns to close an
object and end: a model that copies might then stop where it loops now. Tried on an H200 (ba005e7, 1500 steps, three
at a time, 76-78 s each): S = 0.25 with J = 0.1 copied (second saying 0.33 nats/token) and closed `{}` under the
JSON-object grammar, but looped inside a required tool call until max_tokens (tests/test_structured_outputs.py's
required tool choice); S = J = 0.25 copied (0.31) and looped in the object; S = J = 0.15 did not copy (4.2) and
looped. None is shipped.

--init DIR: go on training the weights of a model this script wrote (its tokenizer too) instead of random ones, for
instance the shipped weights with copies added at a low learning rate, so that what they learned (ending a fortune,
closing `{}` under the JSON-object grammar) is where training starts; the schedule (warm-up, cosine decay) is the
same. On the CPU (float32, 2.2 s a step of 4096 tokens on two cores) a few hundred steps fit in minutes. Tried
from the shipped weights (S = 0.5, peak learning rate 5e-4, 300 steps of 4096 tokens on the CPU, 2026-11-29): no
copying yet (second saying 4.05 nats/token against 4.35 before), and greedy decoding under the JSON-object grammar
already looped until max_tokens (a key, then the same words over and over) where the shipped weights close `{}`.
"""
import argparse
import gzip
import json
import math
import random
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from service.finetune.data import tokenize
from service.finetune.trainer import loss_sum
from service.model import LlamaForCausalLM, ModelConfig

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus.txt.gz"
FORTUNES = Path("/usr/share/games/fortunes")
SEPARATOR = "\n%\n"
EXCLUDED = {"ethnic", "men-women"}  # stereotype jokes: not what a demo model should babble
VOCAB_SIZE = 4096
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # bos/pad, turn start, eos (turn end)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MAX_TOKENS = 384  # longer fortunes are cut (a few long poems)
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB_SIZE, "hidden_size": 320,
    "intermediate_size": 768, "num_hidden_layers": 6, "num_attention_heads": 5, "num_key_value_heads": 1,
    "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
    "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0,
}
SAMPLE_PROMPTS = ["The meaning of life is", "A man walks into a bar", "Q: Why did the chicken cross the road?\nA:",
                  "Never trust a", "You will"]


def prepare_corpus() -> None:
    fortunes = set()
    for path in sorted(FORTUNES.iterdir()):
        if path.suffix in (".dat", ".u8") or not path.is_file() or path.name in EXCLUDED:
            continue
        for text in path.read_text(encoding="latin-1").split("\n%"):
            text = text.strip("\n%").strip()
            if text and all(c.isprintable() or c in "\n\t" for c in text) and text.isascii():
                fortunes.add(text)
    records = sorted(fortunes)
    random.Random(0).shuffle(records)
    CORPUS.write_bytes(gzip.compress(SEPARATOR.join(records).encode(), mtime=0))
    print(f"wrote {len(records)} fortunes, {sum(map(len, records)) / 1e6:.1f} M characters to {CORPUS}")


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out: Path):
    from transformers import PreTrainedTokenizerFast

    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL[0], "eos_token": SPECIAL[2],
        "pad_token": SPECIAL[0], "add_bos_token": False, "model_max_length": CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    return PreTrainedTokenizerFast.from_pretrained(str(out))


def batches(examples, tokens_per_batch: int, rng: random.Random, extra=()):
    """Endless random batches of whole examples holding about tokens_per_batch tokens; extra: (pool, share) pairs,
    a share of the examples drawn from each pool instead."""
    while True:
        batch, size = [], 0
        while size < tokens_per_batch:
            pool = examples
            if extra:  # (no draw without: the shipped weights' stream of examples stays as it was)
                u = rng.random()
                for other, share in extra:
                    if u < share:
                        pool = other
                        break
                    u -= share
            ex = pool[rng.randrange(len(pool))]
            batch.append(ex)
            size += len(ex.token_ids)
        yield batch


def repeated(text: str, rng: random.Random) -> dict:
    """A training record: a fortune said once or twice, a `%` line after each, then said again, the loss on the last
    saying only (the module doc says why)."""
    return {"prompt": SEPARATOR.join([text] * rng.choice((1, 2))) + SEPARATOR, "completion": text}


def as_json(text: str) -> dict:
    """A training record: a fortune as a JSON object, written as the service's JSON outputs are (its words, and who
    said them where it says; the module doc says why)."""
    body, attributed, author = text.rpartition("\n\t\t-- ")
    return {"text": json.dumps({"quote": body, "by": author} if attributed else {"quote": text})}


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak as progress goes from 0 to 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare-corpus", action="store_true", help="build corpus.txt.gz from the fortune files")
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--tokens-per-step", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-seconds", type=float, default=240.0, help="training time budget (the schedule "
                        "ends at --steps or at this, whichever comes first)")
    parser.add_argument("--repeat-share", type=float, default=0.0, help="share of training examples that copy a "
                        "fortune said before them (the module doc says why)")
    parser.add_argument("--json-share", type=float, default=0.0, help="share of training examples that are a "
                        "fortune as a JSON object (the module doc says why)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: float32, for smokes")
    parser.add_argument("--fortunes", type=int, help="train on the corpus's first N fortunes only (smokes)")
    parser.add_argument("--init", help="a model directory this script wrote: go on training its weights, with its "
                        "tokenizer, rather than from random ones (the module doc)")
    args = parser.parse_args(argv)
    if args.prepare_corpus:
        return prepare_corpus()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("training the default model needs a CUDA GPU (--device cpu: a smoke)")
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = gzip.decompress(CORPUS.read_bytes()).decode().split(SEPARATOR)[:args.fortunes]
    tok = Tokenizer.from_file(str(Path(args.init) / "tokenizer.json")) if args.init else train_tokenizer(texts)
    tokenizer = save_tokenizer(tok, out)
    examples = [tokenize({"text": t}, tokenizer) for t in texts]
    for ex in examples:
        ex.token_ids, ex.loss_mask = ex.token_ids[:MAX_TOKENS], ex.loss_mask[:MAX_TOKENS]
    split = len(examples) // 50
    held_out, examples = examples[:split], examples[split:]
    print(f"{len(texts)} fortunes, {sum(len(e.token_ids) for e in examples) / 1e6:.2f} M training tokens")
    rng = random.Random(0)
    repeats, held_out_copies = [], []
    if args.repeat_share:
        # Fortunes that fit MAX_TOKENS whole, said again; of held-out ones, the second saying after the first in the
        # prompt (what copying predicts)
        whole = [len(ex.token_ids) < MAX_TOKENS for ex in held_out + examples]
        repeats = [tokenize(repeated(t, rng), tokenizer)
                   for t, fits in zip(texts[split:], whole[split:]) if fits]
        held_out_copies = [tokenize({"prompt": t + SEPARATOR, "completion": t}, tokenizer)
                           for t, fits in zip(texts[:split], whole[:split]) if fits]

    cfg = ModelConfig.from_dict(CONFIG)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)  # float32 master weights
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
        for layer in model.model.layers:  # residual branches scaled down with depth, as in GPT-2
            layer.self_attn.o_proj.weight.mul_(1 / math.sqrt(2 * cfg.num_hidden_layers))
            layer.mlp.down_proj.weight.mul_(1 / math.sqrt(2 * cfg.num_hidden_layers))
        if args.init:  # (the head is tied to the embedding: not in the file)
            missing, unexpected = model.load_state_dict(load_file(str(Path(args.init) / "model.safetensors")),
                                                        strict=False)
            if set(missing) - {"lm_head.weight"} or unexpected:
                raise SystemExit(f"{args.init}: not this script's model (missing {missing}, unexpected {unexpected})")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.1f} M parameters ({2 * n_params / 2**20:.1f} MiB in bf16)")
    decay = [p for p in model.parameters() if p.dim() > 1]
    other = [p for p in model.parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), fused=device == "cuda")

    def bf16():
        return torch.autocast(device, torch.bfloat16, enabled=device == "cuda")

    def evaluate(held) -> float:
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad(), bf16():
            for i in range(0, len(held), 64):
                loss, n = loss_sum(model, held[i:i + 64], device)
                total, count = total + loss.item(), count + n
        model.train()
        return total / count

    log = {"step": [], "loss": [], "val_step": [], "val_loss": [], "val_copy_loss": []}
    weights = {}

    def keep_if_best(step: int) -> None:
        """The corpus is small (the model sees it ~15 times): keep the weights of the best held-out loss."""
        log["val_step"].append(step)
        log["val_loss"].append(evaluate(held_out))
        if held_out_copies:
            log["val_copy_loss"].append(evaluate(held_out_copies))
            print(f"held out: loss {log['val_loss'][-1]:.3f}, second saying {log['val_copy_loss'][-1]:.3f}")
        if log["val_loss"][-1] <= min(log["val_loss"]):
            weights.update({k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
                            if k != "lm_head.weight"})

    start, done = time.perf_counter(), 0
    jsons = [tokenize(as_json(t), tokenizer) for t in texts[split:]] if args.json_share else []
    extra = [(pool, share) for pool, share in ((repeats, args.repeat_share), (jsons, args.json_share)) if share]
    stream = batches(examples, args.tokens_per_step, rng, extra)
    for step in range(args.steps):
        # Progress in steps or in time, whichever is further: a slower GPU still ends its schedule in time.
        progress = max(step / args.steps, (time.perf_counter() - start) / args.max_seconds)
        if progress >= 1:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, progress, args.lr, warmup=100)
        with bf16():
            loss, n = loss_sum(model, next(stream), device)
        (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        if step % 25 == 0 or step == args.steps - 1:
            log["step"].append(step)
            log["loss"].append(loss.item() / n)
            print(f"step {step:5d}  loss {log['loss'][-1]:.3f}  {time.perf_counter() - start:6.1f} s", flush=True)
        if step % 100 == 99:
            keep_if_best(step)
    keep_if_best(done)
    seconds = time.perf_counter() - start
    print(f"trained {done} steps in {seconds:.0f} s; best held-out loss {min(log['val_loss']):.3f}")

    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**CONFIG, "_comment": "trained by train_default.py on Debian's "
                                                 "fortune files"}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "bos_token_id": 0}) + "\n")
    samples, json_object = sample(out, device)
    (out / "training_log.json").write_text(json.dumps({**log, "seconds": seconds, "steps": done, "args": vars(args),
                                                       "samples": samples, "json_object": json_object}, indent=1))
    plot(log, out / "loss_curve.png")
    print(f"wrote the model to {out}")


def sample(model_dir: Path, device: str) -> tuple[dict[str, str], dict[str, str]]:
    """Continuations of a few prompts by the saved model, through the serving engine; and its greedy answer to a
    chat question under a JSON-object grammar, with the reason it ended (a model that copies its own output can
    loop there until max_new_tokens: the module doc's --repeat-share)."""
    from transformers import PreTrainedTokenizerFast

    from service.engine.llm import LLM
    from service.protocol import Grammar, SamplingParams

    llm = LLM(str(model_dir), device=device, **({"gpu_memory_utilization": 0.2} if device == "cuda" else {}))
    params = SamplingParams(max_new_tokens=60, temperature=0.7, top_p=0.9, seed=0)
    outputs = llm.generate(SAMPLE_PROMPTS, params)
    samples = {p: o.text for p, o in zip(SAMPLE_PROMPTS, outputs)}
    for p, text in samples.items():
        print(f"--- {p!r} -> {text!r}")
    chat = PreTrainedTokenizerFast.from_pretrained(str(model_dir)).apply_chat_template(
        [{"role": "user", "content": "What is the weather in Paris?"}], tokenize=False, add_generation_prompt=True)
    (out,) = llm.generate([chat], SamplingParams(max_new_tokens=300, temperature=0.0, grammar=Grammar("json")))
    print(f"--- JSON object, greedy ({out.finish_reason}) -> {out.text[:200]!r}")
    return samples, {"finish_reason": out.finish_reason, "text": out.text}


def plot(log: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(log["step"], log["loss"], label="training")
    ax.plot(log["val_step"], log["val_loss"], "o-", label="held out")
    if log["val_copy_loss"]:
        ax.plot(log["val_step"], log["val_copy_loss"], "s-", label="held out, second saying")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="default model on the fortune files")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
