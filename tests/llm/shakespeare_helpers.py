"""The committed Shakespeare models, shared by the LLM tests of every layer: the default LLM's
checkpoint (models/shakespeare-llama), its LoRA adapter (models/shakespeare-sonnets-lora) and
its speculative-decoding draft model (models/shakespeare-draft),
held-out text in the training text's form, and perplexity under a transformers model."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from tooling.repository import REPO_ROOT

SHAKESPEARE = REPO_ROOT / "models" / "shakespeare-llama"
"""The default LLM (model_repository/llm's `model`): byte-level BPE, 4096 tokens, EOS 2."""
SONNETS_ADAPTER = REPO_ROOT / "models" / "shakespeare-sonnets-lora"
"""The shipped LoRA adapter on SHAKESPEARE (scripts/train_shakespeare.py --lora)."""
SHAKESPEARE_DRAFT = REPO_ROOT / "models" / "shakespeare-draft"
"""The shipped one-layer draft model of SHAKESPEARE (scripts/train_shakespeare.py --draft)."""

# From the validation split (the held-out last 5% of each document), in the training text's form.
HELD_OUT = {
    "Romeo and Juliet, V.3": """CAPULET:
O brother Montague, give me thy hand:
This is my daughter's jointure, for no more
Can I demand.

MONTAGUE:
But I can give thee more:
For I will raise her statue in pure gold;
That while Verona by that name is known,
There shall no figure at such rate be set
As that of true and faithful Juliet.

CAPULET:
As rich shall Romeo's by his lady's lie;
Poor sacrifices of our enmity!

PRINCE:
A glooming peace this morning with it brings;
  The sun for sorrow will not show his head.
Go hence, to have more talk of these sad things;
  Some shall be pardon'd, and some punished;
For never was a story of more woe
Than this of Juliet and her Romeo.
""",
    "Sonnet 154": """The little Love-god lying once asleep,
Laid by his side his heart-inflaming brand,
Whilst many nymphs that vow'd chaste life to keep
Came tripping by; but in her maiden hand
The fairest votary took up that fire
Which many legions of true hearts had warm'd;
And so the general of hot desire
Was, sleeping, by a virgin hand disarm'd.
""",
}


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, ids: list[int]) -> float:
    """exp(mean cross-entropy) of every token after the first, given its prefix."""
    logits = model(torch.tensor([ids])).logits[0, :-1]
    return math.exp(F.cross_entropy(logits, torch.tensor(ids[1:])).item())
