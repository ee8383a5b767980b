"""The ``hf`` family and remote code (docs/hf_models.md, "Remote code"): a local folder whose
``config.json`` names its own Python classes (``auto_map``) is refused, one line naming
``model.hf_trust_remote_code``, unless the user turns that field on; then our build gives the
logits of transformers' ``from_pretrained(folder, trust_remote_code=True)`` and trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.hf_models import save_model
from torchtitan.checkpoint import hf_io
from torchtitan.models import MODELS, flavor_of, run_args
from torchtitan.preflight.validate import load_config

SPEC = MODELS["hf"]
VOCAB = 2048

CONFIGURATION = """
from transformers import LlamaConfig


class TitanXConfig(LlamaConfig):
    model_type = "titan_x"
"""

MODELING = """
from transformers import LlamaForCausalLM

from .configuration_titan_x import TitanXConfig


class TitanXForCausalLM(LlamaForCausalLM):
    config_class = TitanXConfig
"""


def remote_code_folder(folder: Path) -> Path:
    """A tiny Llama saved under a model type transformers does not know, with its classes as
    remote code next to the weights (``auto_map``)."""
    save_model("mistral", folder)
    (folder / "configuration_titan_x.py").write_text(CONFIGURATION)
    (folder / "modeling_titan_x.py").write_text(MODELING)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="titan_x",
        architectures=["TitanXForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_titan_x.TitanXConfig",
            "AutoModelForCausalLM": "modeling_titan_x.TitanXForCausalLM",
        },
    )
    for key in ("sliding_window", "use_sliding_window", "max_window_layers"):
        config.pop(key, None)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _argv(folder: Path, *extra: str) -> list[str]:
    return ["--model.name", "hf", "--model.flavor", str(folder), *extra]


def test_remote_code_is_refused_without_the_field(tmp_path: Path, capsys) -> None:
    from torchtitan.train import main

    folder = remote_code_folder(tmp_path / "x")
    assert main(_argv(folder)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    line = [e for e in err if "auto_map" in e]
    assert len(line) == 1 and "model.hf_trust_remote_code = true" in line[0], err
    assert "with this process's rights" in line[0]
    with pytest.raises(Exception, match="only the hf family"):
        load_config(["--model.hf_trust_remote_code"], world_size=1)


def test_remote_code_with_the_field_gives_transformers_logits_and_trains(
    tmp_path: Path, caplog
) -> None:
    from transformers import AutoModelForCausalLM

    folder = remote_code_folder(tmp_path / "x")
    cfg = load_config(_argv(folder, "--model.hf_trust_remote_code"), world_size=1)
    with caplog.at_level("WARNING"):
        args = run_args(cfg, VOCAB)
    assert args.trust_remote_code and flavor_of(cfg) == str(folder)
    with torch.device("meta"):
        ours = SPEC.build(args)
    assert type(ours).__mro__[2].__name__ == "TitanXForCausalLM"
    ours.to_empty(device="cpu")
    ours.init_weights(3)
    hf_io.load_hf_streaming([ours], SPEC.state_dict_adapter(args), folder)
    theirs = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(theirs).__name__ == "TitanXForCausalLM"
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(input_ids=tokens).logits
        got = ours.eval()(tokens)
    assert (got - want).abs().max().item() == 0.0

    ours.train()
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        logits = ours(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def test_evaluation_builds_remote_code_only_with_the_field(tmp_path: Path) -> None:
    """Evaluation's loader looks the folder up with the same opt-in as training."""
    from torchtitan.config.errors import ConfigError
    from torchtitan.eval.loading import checkpoint_args

    folder = remote_code_folder(tmp_path / "x")
    with pytest.raises(ConfigError, match="hf_trust_remote_code"):
        checkpoint_args(folder, True, "hf", str(folder))
    family, args = checkpoint_args(folder, True, "hf", str(folder), trust_remote_code=True)
    assert family == "hf" and args.trust_remote_code
