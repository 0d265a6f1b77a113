"""What a request asks of generation, independent of the HTTP schema that carried it."""
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 means greedy
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
        return self.temperature == 0.0
