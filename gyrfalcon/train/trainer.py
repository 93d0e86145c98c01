"""DraftTrainer: trains an EAGLE-3 head (models/eagle3.py Eagle3Draft, so the saved weights load back through the
same code) on captured target hidden states, and `train_draft`, the whole `gyrfalcon train-draft` run.

Determinism, so a resumed run ends where an uninterrupted one does: the head's initialization comes from the
training seed; epoch e visits the sequences in the permutation a generator seeded (seed, e) draws; nothing else
is random (no dropout). A checkpoint (train_state.pt in the output directory) holds the step, the head's
parameters, AdamW's and the LR schedule's state; the captured data is saved once beside it (captured.pt), so
--resume neither regenerates nor recaptures.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from gyrfalcon.train.data import CapturedSequence
from gyrfalcon.train.ttt import ttt_loss

logger = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
DATA_FILE = "captured.pt"


class DraftTrainer:
    def __init__(self, target_model, data: List[CapturedSequence], draft_ids: torch.Tensor, cfg: dict,
                 device, *, batch_size: int = 8, ttt_steps: int = 3, epochs: int = 1, lr: float = 1e-3,
                 schedule: str = "cosine", warmup_steps: int = 0, weight_decay: float = 0.0, seed: int = 0,
                 max_positions: Optional[int] = None, init_draft: Optional[str] = None) -> None:
        """target_model: the engine's loaded CausalLM (its embedding feeds the head; its LM head gives the target's
        logits); cfg: the draft's speculators config.json (export.draft_config); draft_ids: [V_draft] ascending.
        init_draft: a speculators-layout draft directory whose weights the head starts from instead of the seed's
        initialization (its config must be `cfg` and its vocabulary `draft_ids`: init_draft_setup gives both)."""
        from gyrfalcon.models.eagle3 import Eagle3Draft, parse_eagle3_config
        from gyrfalcon.train.vocab import d2t_t2d

        if schedule not in ("cosine", "constant"):
            raise ValueError(f"LR schedule {schedule!r}: cosine or constant.")
        if batch_size < 1 or ttt_steps < 1 or epochs < 1:
            raise ValueError("batch size, TTT steps and epochs must be at least 1.")
        self.target, self.data, self.cfg, self.device = target_model, data, cfg, torch.device(device)
        self.batch_size, self.ttt_steps, self.epochs, self.seed = batch_size, ttt_steps, epochs, seed
        self.draft_ids = draft_ids.to(self.device)
        spec = parse_eagle3_config(cfg, target_model.config)
        with torch.random.fork_rng(devices=[]):  # the seed fixes the head's initialization, and nothing else
            torch.manual_seed(seed)
            self.draft = Eagle3Draft(spec, target_model.model.embed_tokens, 0, max_positions)
        d2t, self.t2d = d2t_t2d(draft_ids.cpu(), spec.target_vocab_size)
        self.draft.d2t.copy_(d2t)
        if init_draft is not None:
            from gyrfalcon.models.loader import iterate_safetensors
            self.draft.load_weights(iterate_safetensors(init_draft))
            if not torch.equal(self.draft.d2t, d2t):
                raise ValueError(f"The draft in {init_draft} maps another vocabulary than the one given.")
        self.draft = self.draft.to(self.device, torch.float32)
        for p in self.draft.parameters():
            p.requires_grad_(True)
        # On a GPU the head's matmuls run in bf16 under autocast (fp32 weights, AdamW state and loss: the
        # log-softmaxes and the KL stay fp32), and the captured states move onto the GPU when they take under half
        # of its free memory: padding a batch there instead of on the host keeps the host's copies out of each step.
        self.autocast = self.device.type == "cuda"
        self.data_device = torch.device("cpu")
        if self.device.type == "cuda":
            need = sum(d.aux.nbytes + d.final.nbytes for d in data)
            if need < 0.5 * torch.cuda.mem_get_info(self.device)[0]:
                self.data = [CapturedSequence(d.ids, d.prompt_len, d.aux.to(self.device), d.final.to(self.device))
                             for d in data]
                self.data_device = self.device
        self.batches_per_epoch = math.ceil(len(data) / batch_size)
        self.total_steps = self.batches_per_epoch * epochs
        self.optimizer = torch.optim.AdamW(self.draft.parameters(), lr=lr, weight_decay=weight_decay)

        def factor(step: int) -> float:
            if step < warmup_steps:
                return (step + 1) / warmup_steps
            if schedule == "constant":
                return 1.0
            t = (step - warmup_steps) / max(1, self.total_steps - warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.step = 0

    # ---- batches --------------------------------------------------------------------------------
    def _order(self, epoch: int) -> List[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.data), generator=g).tolist()

    def batch(self, step: int):
        """The step's sequences, padded: ids [B, T], aux [B, T, 3H], target_logp [B, T, V_draft], lens, prompt_lens."""
        epoch, i = divmod(step, self.batches_per_epoch)
        idx = self._order(epoch)[i * self.batch_size:(i + 1) * self.batch_size]
        seqs = [self.data[j] for j in idx]
        T = max(len(s.ids) for s in seqs)
        B, dev, ddev = len(seqs), self.device, self.data_device
        ids = torch.zeros(B, T, dtype=torch.int64)
        aux = torch.zeros(B, T, seqs[0].aux.shape[-1], device=ddev)
        final = torch.zeros(B, T, seqs[0].final.shape[-1], dtype=seqs[0].final.dtype, device=ddev)
        for b, s in enumerate(seqs):
            n = len(s.ids)
            ids[b, :n], aux[b, :n], final[b, :n] = s.ids, s.aux, s.final
        with torch.no_grad():  # (not inference_mode: the loss multiplies these into tensors that need grad)
            logits = self.target.compute_logits(final.to(dev).view(B * T, -1))
            logp = logits[:, self.draft_ids].float().log_softmax(-1).view(B, T, -1)
        lens = torch.tensor([len(s.ids) for s in seqs], device=dev)
        plens = torch.tensor([s.prompt_len for s in seqs], device=dev)
        return ids.to(dev), aux.to(dev), logp, lens, plens

    # ---- training -------------------------------------------------------------------------------
    def train_step(self) -> tuple:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            loss, agree = ttt_loss(self.draft, *self.batch(self.step), steps=self.ttt_steps)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return loss.item(), agree

    def train(self, out_dir: Path, save_every: int = 0, stop_after: Optional[int] = None,
              use_tqdm: bool = True) -> None:
        """Steps from self.step to the schedule's end (or until stop_after steps in total), a checkpoint every
        save_every steps and at the end."""
        end = self.total_steps if stop_after is None else min(self.total_steps, stop_after)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=self.total_steps, initial=self.step, desc="Training draft", dynamic_ncols=True)
        while self.step < end:
            loss, agree = self.train_step()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", acc="/".join(f"{a:.2f}" for a in agree))
            if save_every and self.step % save_every == 0:
                self.save_state(out_dir)
        if bar is not None:
            bar.close()
        self.save_state(out_dir)

    # ---- checkpoints ----------------------------------------------------------------------------
    def save_state(self, out_dir: Path) -> None:
        state = {"step": self.step, "draft": {k: v.cpu() for k, v in self.draft.state_dict().items()},
                 "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "draft_ids": self.draft_ids.cpu(), "total_steps": self.total_steps, "seed": self.seed}
        tmp = out_dir / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(out_dir / STATE_FILE)  # (a run killed mid-save keeps the previous checkpoint)

    def load_state(self, out_dir: Path) -> None:
        state = torch.load(out_dir / STATE_FILE, map_location=self.device, weights_only=True)
        if not torch.equal(state["draft_ids"].cpu(), self.draft_ids.cpu()) or state["total_steps"] != \
                self.total_steps or state["seed"] != self.seed:
            raise ValueError(f"The checkpoint in {out_dir} is of another run (draft vocabulary, schedule length or "
                             "seed differ): resume with the same flags, or start a new --out.")
        self.draft.load_state_dict(state["draft"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])

    def export(self, out_dir: Path, dtype: torch.dtype) -> None:
        from gyrfalcon.train.export import save_speculators
        save_speculators(out_dir, self.cfg, self.draft, self.t2d, dtype)


def init_draft_setup(path: str, target_hf_config) -> tuple:
    """A speculators-layout draft to continue training (train-draft --init-draft): -> (its config.json, its
    aux layer ids, its draft vocabulary [V_draft] ascending target ids, from d2t). Fine-tuning keeps the head's
    shape, vocabulary and aux layers: those are what its weights mean."""
    import json

    from safetensors import safe_open

    from gyrfalcon.models.eagle3 import default_aux_layer_ids, detect_format, parse_eagle3_config

    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"--init-draft: no config.json in {path}.")
    cfg = json.loads(cfg_path.read_text())
    if detect_format(cfg) != "speculators":
        raise ValueError(f"--init-draft takes a draft in the speculators layout (what train-draft saves); {path} "
                         f"is in the {detect_format(cfg)} layout.")
    spec = parse_eagle3_config(cfg, target_hf_config)
    files = sorted(Path(path).glob("*.safetensors"))
    d2t = None
    for f in files:
        with safe_open(str(f), "pt") as h:
            if "d2t" in h.keys():
                d2t = h.get_tensor("d2t").to(torch.int64)
            if any(k.endswith("embed_tokens.weight") for k in h.keys()):
                raise ValueError(f"--init-draft: the draft in {path} brings its own embedding; train-draft trains "
                                 "heads that read the target's.")
    if d2t is None:
        if spec.draft_vocab_size != spec.target_vocab_size:
            raise ValueError(f"--init-draft: the draft in {path} has a draft vocabulary but no d2t.")
        d2t = torch.zeros(spec.draft_vocab_size, dtype=torch.int64)
    draft_ids = torch.arange(len(d2t), dtype=torch.int64) + d2t
    aux = spec.aux_layer_ids or default_aux_layer_ids(target_hf_config.num_hidden_layers)
    return cfg, sorted(int(i) for i in aux), draft_ids


def train_draft(model: str, prompts_path: str, out: str, engine_kwargs: dict, *, max_tokens: int = 256,
                temperature=0.0, raw_prompts: bool = False, draft_vocab_size: int = 32000,
                aux_layer_ids: Optional[Sequence[int]] = None, num_speculative_tokens: int = 3,
                resume: bool = False, save_every: int = 0, stop_after: Optional[int] = None,
                eval_prompts: Optional[str] = None, use_tqdm: bool = True, init_draft: Optional[str] = None,
                **train_kw) -> Path:
    """The whole run: regenerate, capture, choose the vocabulary, train, save in the speculators layout under
    `out`; with eval_prompts (a prompts file), then log the draft's mean acceptance length on them (greedy, k =
    num_speculative_tokens, max_tokens each). init_draft: start from that draft's weights, keeping its
    vocabulary, aux layers and config (init_draft_setup). train_kw: DraftTrainer's keywords (batch_size,
    ttt_steps, epochs, lr, schedule, ...)."""
    from gyrfalcon.llm import LLM
    from gyrfalcon.models.eagle3 import default_aux_layer_ids
    from gyrfalcon.train import data as D
    from gyrfalcon.train.export import draft_config
    from gyrfalcon.train.vocab import choose_draft_vocab

    out_dir = Path(out)
    if resume and not (out_dir / STATE_FILE).exists():
        raise FileNotFoundError(f"--resume: no {STATE_FILE} in {out_dir}.")
    if not resume and (out_dir / STATE_FILE).exists():
        raise ValueError(f"{out_dir} holds a training checkpoint: pass --resume to continue it, or another --out.")
    out_dir.mkdir(parents=True, exist_ok=True)
    # The target runs plain (a speculative_config from the flags is for serving, not for regenerating the data).
    engine_kwargs = {k: v for k, v in engine_kwargs.items() if k != "speculative_config"}
    if engine_kwargs.get("tensor_parallel_size", 1) != 1:
        raise ValueError("train-draft runs the target in one process: use --tensor-parallel-size 1.")
    llm = LLM(model, **engine_kwargs)
    target = llm.engine.runner.model
    hf = target.config
    aux_ids = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(hf.num_hidden_layers)
    if init_draft is not None:
        init_cfg, init_aux, init_ids = init_draft_setup(init_draft, hf)
        if aux_layer_ids and sorted(aux_layer_ids) != init_aux:
            raise ValueError(f"--aux-layers {list(aux_layer_ids)}: the draft in {init_draft} reads {init_aux}.")
        aux_ids = init_aux
    if len(set(aux_ids)) != 3 or any(not 0 <= i <= hf.num_hidden_layers for i in aux_ids):
        raise ValueError(f"EAGLE-3 reads three distinct aux layers in [0, {hf.num_hidden_layers}], got {aux_ids}.")
    aux_ids = sorted(aux_ids)
    if resume and (out_dir / DATA_FILE).exists():
        captured = D.load_captured(out_dir / DATA_FILE)
    else:
        prompts = D.load_prompts(prompts_path)
        seqs = D.generate_sequences(llm, prompts, max_tokens, temperature, raw_prompts, seed=train_kw.get("seed"))
        captured = D.capture(llm, seqs, aux_ids)
        D.save_captured(captured, out_dir / DATA_FILE)
    if init_draft is not None:
        draft_ids, cfg = init_ids, init_cfg
    else:
        vocab = hf.vocab_size
        draft_ids = choose_draft_vocab((s.ids for s in captured), vocab, min(draft_vocab_size, vocab))
        cfg = draft_config(hf, model, len(draft_ids), aux_ids, num_speculative_tokens)
    trainer = DraftTrainer(target, captured, draft_ids, cfg, llm.config.device,
                           max_positions=llm.config.model_config.max_model_len + num_speculative_tokens,
                           init_draft=init_draft, **train_kw)
    if resume:
        trainer.load_state(out_dir)
        logger.info("resumed at step %d of %d", trainer.step, trainer.total_steps)
    trainer.train(out_dir, save_every, stop_after, use_tqdm)
    trainer.export(out_dir, llm.config.model_config.torch_dtype)
    if eval_prompts:
        import gc

        from gyrfalcon.train.evaluate import held_out_acceptance
        held = D.encode_prompts(llm.get_tokenizer(), D.load_prompts(eval_prompts), raw_prompts)
        del trainer, llm, target  # the evaluation engine sizes its KV cache from the free device memory
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        mal, per_pos = held_out_acceptance(model, str(out_dir), held, num_speculative_tokens, max_tokens,
                                           **engine_kwargs)
        print(f"held-out mean acceptance length (k={num_speculative_tokens}, greedy, {len(held)} prompts): "
              f"{mal:.3f}; accepted per position {' / '.join(f'{a:.3f}' for a in per_pos)}")
    return out_dir
