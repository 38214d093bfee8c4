"""One `Trainer.fit` of a tiny LightningModule whose layer is compiled in configure_model (inductor on
CPU) with the CompileCache callback, in a process of its own so that torch's in-memory caches start
empty (tests/callbacks/test_compile_cache.py).

    python compile_cache_script.py ROOT_DIR OUT.json

OUT.json gets whether the callback loaded a bundle, the run's cache-lookup counts (read_cache_counts)
and the training losses.
"""
import json
import sys

import lightning as L
import torch

from lightning_adaptiveload.callbacks import CompileCache
from lightning_adaptiveload.compile_cache import read_cache_counts


class Net(torch.nn.Module):
    """A class of this file: dynamo does not start a compiled frame in torch.nn's own forwards, so a
    compiled torch.nn.Sequential would run eagerly."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class TinyModule(L.LightningModule):
    def __init__(self, compile: str = "auto"):
        super().__init__()
        self.save_hyperparameters()
        self.net = Net()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        self.net.compile()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.net(x) - y).square().mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(root: str, out: str) -> None:
    torch.manual_seed(0)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(3)]
    callback = CompileCache()
    module = TinyModule()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                        callbacks=[callback])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    with open(out, "w") as f:
        json.dump({"loaded": callback.loaded, "counts": read_cache_counts(), "losses": module.losses,
                   "key": callback.cache.key}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
