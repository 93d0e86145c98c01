"""runner.model_runner.start_device_init: the CUDA context is created in a background thread while the config and
tokenizer load (LLM and the engine-core process call it first), only where a GPU will be used."""

from __future__ import annotations

import threading

import torch

from gyrfalcon.runner import model_runner


def test_starts_a_thread_that_makes_the_cuda_context(monkeypatch):
    calls = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            calls.append((args, threading.current_thread().name))
            return real_empty(*args)
        return real_empty(*args, **kwargs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", empty)
    for device in ("auto", "cuda"):
        t = model_runner.start_device_init(device)
        t.join(10)
        assert t.daemon and not t.is_alive()
    assert calls == [((1,), "gyrfalcon-device-init")] * 2
    # A failure there is left for the runner's own first CUDA call to report.
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no driver")))
    t = model_runner.start_device_init("cuda")
    t.join(10)
    assert not t.is_alive()


def test_nothing_without_a_gpu_or_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert model_runner.start_device_init("auto") is None and model_runner.start_device_init("cuda") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert model_runner.start_device_init("cpu") is None
