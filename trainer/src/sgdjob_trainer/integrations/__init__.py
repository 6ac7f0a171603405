"""Framework integrations of SGDJob's adaptation API (docs/adaptation-api.md), each an optional extra:
`hf` (`pip install sgdjob[hf]`) for Hugging Face `transformers.Trainer`, `lightning`
(`pip install sgdjob[lightning]`) for PyTorch Lightning's `Trainer`. Nothing here imports a framework;
import the integration's own module (`sgdjob_trainer.integrations.hf`, `...integrations.lightning`)."""

# Why a job through an integration refuses `mode: async` (Session.refuse_async): the frameworks' loops
# count their own steps and run collectives of their own (loss logging, evaluation, saving), which
# async's unequal step counts per rank would pair up wrongly; not checked yet. Plain scripts on the
# adaptation API run it.
ASYNC_REFUSED = (
    "the framework integrations do not run async yet (their trainers count steps and run collectives "
    "of their own, which async's unequal steps per rank would misalign); the plain adaptation API does"
)
