"""What a request asks of generation, independent of the HTTP schema that carried it."""
from dataclasses import dataclass, field

# Temperatures below this sample greedily: dividing logits by a smaller one overflows float32 (1e-45 is already
# 0 there), and the distribution it asks for is the argmax anyway.
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_K = 2**31 - 1  # any k beyond the vocabulary keeps every token


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 (or anything below GREEDY_TEMPERATURE) means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # same seed -> same tokens
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # TGI returns the stop string, OpenAI does not
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # report the sampled token's logprob
    top_logprobs: int = 0
    detokenize: bool = True  # False: TokenOutput.text stays "" and stop strings are not checked (benchmarks)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
