"""``eagle``: an EAGLE-3-style draft head over the target's own features: its architecture (:mod:`.head`), the
form decoding runs (:mod:`.runtime`) and the method (:mod:`.method`)."""
