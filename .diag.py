import sys, tempfile
from pathlib import Path
sys.path.insert(0, ".")
import torch
from benchmarks.lora import start_decoding, finish
from benchmarks.timing import replay_ms
from benchmarks.generate import write_checkpoint
from service.engine.llm import LLM
tmp = Path(tempfile.mkdtemp()); write_checkpoint(tmp)
llm = LLM(str(tmp), dtype="bfloat16", gpu_memory_utilization=0.6, max_model_len=4096)
eng = llm.engine; r = eng.runner
def state(tag, bs=64):
    g = r.graphs[bs]; ms = replay_ms(g)
    out = r.graph_logits[bs]
    out = out[0] if isinstance(out, (tuple, list)) else out
    print(f"{tag:40s} {ms:.3f} ms  logits nan {torch.isnan(out.float()).any().item()} absmax {out.float().abs().max().item():.3g}", flush=True)
start_decoding(eng, 64, [], "a", 100)
state("engine steps")
finish(eng); state("after finish")
with torch.inference_mode():
    r._decode_forward(64)()
torch.cuda.synchronize(); state("after eager forward")
key = next(iter(r.prefill_graphs)); r.prefill_graphs[key].replay(); torch.cuda.synchronize()
state(f"after prefill graph {key}")
with torch.inference_mode():
    r._decode_forward(64)()
state("eager again")
start_decoding(eng, 64, [], "b", 100); finish(eng); state("engine steps again")
state("b1 slow?", 1)
with torch.inference_mode():
    r._decode_forward(1)()
state("b1 after eager b1", 1)
