import atexit
from dataclasses import fields
from time import perf_counter

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.tensor_parallel import check_workers, start_workers, stop_workers
from nanovllm.sampling_params import SamplingParams


class LLMEngine:
    """Tokenizes requests, runs the schedule -> model -> postprocess loop, and detokenizes results."""

    def __init__(self, model: str, **kwargs):
        names = {f.name for f in fields(Config) if f.init}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown argument(s) {unknown}; LLM takes: {sorted(names - {'model'})}")
        self._exited = True
        self._in_flight = None      # (sequences awaiting each row, SampledTokens) of the step launched last
        self._ended_seq_ids: list[int] = []     # told to the runner with the next step (frees sampling state)
        config = Config(model, **kwargs)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.output_processor = OutputProcessor(self.tokenizer)
        if self.tokenizer.eos_token_id is not None:
            config.eos_token_ids = config.eos_token_ids | {self.tokenizer.eos_token_id}
        self.workers = start_workers(config, ModelRunner)
        try:
            self.model_runner = ModelRunner(config, 0, self.workers.events, self.workers.store_port,
                                            self.workers.shm_name)
        except BaseException:
            stop_workers(self.workers, timeout=0)
            raise
        self.scheduler = Scheduler(config, self.model_runner.num_kvcache_blocks)
        self.vocab_size = config.hf_config.vocab_size
        self._exited = False
        atexit.register(self.exit)

    def exit(self) -> None:
        """Stop the workers and free the device memory; safe to call twice, and called at exit."""
        if self._exited:
            return
        self._exited = True
        atexit.unregister(self.exit)
        workers_alive = all(process.is_alive() for process in self.workers.processes)
        if workers_alive:
            self.model_runner.call("exit")      # every rank leaves its loop and releases its group
        else:
            self.model_runner.exit()            # a dead worker cannot hear "exit": the rest get killed
        del self.model_runner
        stop_workers(self.workers, timeout=30 if workers_alive else 0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.exit()

    # ---- requests -------------------------------------------------------------------------------------
    def _make_sequence(self, prompt: str | list[int], sampling_params: SamplingParams) -> Sequence:
        """Check one request in full, without touching any engine state."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is an empty string")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise TypeError("a token-id prompt must be a list of ints")
            token_ids = list(prompt)
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        else:
            raise TypeError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt has no tokens")
        max_len = self.config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens leaves no room to generate within "
                             f"max_model_len={max_len}")
        bad = [t for t in sampling_params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids holds {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        block_size, num_blocks = self.config.kvcache_block_size, len(self.scheduler.block_manager.blocks)
        longest = min(len(token_ids) + sampling_params.max_tokens, max_len)
        if (longest + block_size - 1) // block_size > num_blocks:
            raise ValueError(f"a request of up to {longest} tokens can never fit in the KV cache of "
                             f"{num_blocks} blocks of {block_size} tokens; lower max_tokens or "
                             f"give the cache more blocks")
        if (len(token_ids) + block_size - 1) // block_size + sampling_params.n - 1 > num_blocks:
            raise ValueError(f"n={sampling_params.n} completions of a {len(token_ids)}-token prompt can never "
                             f"start in the KV cache of {num_blocks} blocks of {block_size} tokens")
        return Sequence(token_ids, sampling_params, block_size)

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> int:
        seq = self._make_sequence(prompt, sampling_params)
        self.scheduler.add(seq)
        return seq.seq_id

    def step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """Schedule and launch one batch, then collect the batch launched before it: the device runs
        one step while the host prepares the next. Returns finished (seq_id, completion token ids) and
        the tokens launched (positive for prefill, negative for decode: the tqdm bar tells them apart)."""
        finished, num_tokens = self._step()
        return [(seq.seq_id, seq.completion_token_ids) for seq in finished], num_tokens

    def _step(self) -> tuple[list[Sequence], int]:
        seqs, is_prefill = self.scheduler.schedule()
        launched, num_tokens = None, 0
        if seqs:
            num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else -len(seqs)
            check_workers(self.workers)
            sampled = self.model_runner.call("run", seqs, is_prefill, self.scheduler.block_copies,
                                             self._ended_seq_ids)
            self._ended_seq_ids = []
            launched = (self.scheduler.launched(seqs), sampled)
        elif self._in_flight is None:
            raise RuntimeError("the scheduler could schedule nothing although requests are pending")
        previous, self._in_flight = self._in_flight, launched
        if previous is None:
            return [], num_tokens
        awaiting, sampled = previous
        token_ids = sampled.tolist()
        logprobs = sampled.logprobs()
        if logprobs is not None:
            self.output_processor.record_logprobs(awaiting, token_ids, logprobs)
        finished = self.scheduler.postprocess(awaiting, token_ids, self.output_processor.stop_check)
        self._ended_seq_ids.extend(seq.seq_id for seq in finished)
        return finished, num_tokens

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self._in_flight is None

    @property
    def stats(self) -> dict:
        return self.scheduler.stats()

    def generate(self, prompts: list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True) -> list[dict]:
        """Run every prompt to completion; outputs ({"text", "token_ids"}) come back in input order."""
        if self._exited:
            raise RuntimeError("this engine has exited")
        if not isinstance(prompts, list):
            raise TypeError(f"prompts must be a list of str or of token-id lists, got {type(prompts).__name__}")
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        elif len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        seqs = [self._make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        if not seqs:
            return []
        for seq in seqs:
            self.scheduler.add(seq)
        completions: dict[int, list[Sequence]] = {seq.seq_id: [] for seq in seqs}   # by request (first seq)
        pbar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_throughput = decode_throughput = 0.0
        try:
            while not self.is_finished():
                t = perf_counter()
                finished, num_tokens = self._step()
                elapsed = perf_counter() - t
                if num_tokens > 0:
                    prefill_throughput = num_tokens / elapsed
                elif num_tokens < 0:
                    decode_throughput = -num_tokens / elapsed
                if use_tqdm:
                    stats = self.stats
                    pbar.set_postfix(prefill=f"{int(prefill_throughput)}tok/s",
                                     decode=f"{int(decode_throughput)}tok/s",
                                     hit=f"{stats['prefix_cache_hit_rate']:.0%}", preempt=stats["num_preemptions"])
                for seq in finished:
                    group = completions.get(seq.parent_id)
                    if group is not None:
                        group.append(seq)
                        if len(group) == seq.sampling_params.n:
                            pbar.update(1)
        except BaseException:
            self._in_flight = None
            self._ended_seq_ids.extend(seq.seq_id for seq in self.scheduler.abort_all())
            raise
        finally:
            pbar.close()
        return [self.output_processor.request_output(completions[seq.seq_id]) for seq in seqs]
