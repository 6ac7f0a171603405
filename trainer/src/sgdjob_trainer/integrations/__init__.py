"""Framework integrations of SGDJob's adaptation API (docs/adaptation-api.md), each an optional extra:
`hf` (`pip install sgdjob[hf]`) for Hugging Face `transformers.Trainer`, `lightning`
(`pip install sgdjob[lightning]`) for PyTorch Lightning's `Trainer`. Nothing here imports a framework;
import the integration's own module (`sgdjob_trainer.integrations.hf`, `...integrations.lightning`)."""
