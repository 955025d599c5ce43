"""The model card (`README.md`) a run leaves in its output folder, one module per part:

- `builder`: the card's text (`build_model_card`) and what a trainer writes (`write_model_card`, with `report.png`);
- `objective`: the formula block of the objective that ran, from the loss type's record and the options;
- `fields`: the configuration fields that acted, as the user set them;
- `quick_start`: where the trained model is loaded from, and the code that loads it;
- `stock`: what stock TRL's card holds (its tags and sections), rendered by TRL.
"""

from .builder import build_model_card, write_model_card

__all__ = ["build_model_card", "write_model_card"]
