"""``mirrorsd distill``: the target's own answers to many prompts of our own making, for training drafts."""
