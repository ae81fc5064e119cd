"""Real English words, for scoring whether reversing and counting carry over from the made-up words the
model is trained on to words people type (`launch eval --english`). Training draws random and
English-looking letter strings (words.py), never this list on purpose; a drawn string can still
coincide with one of these words, which is rare and harmless."""

ENGLISH_WORDS = tuple(
    """
    cat dog sun tree book door milk fish bird rain snow wind fire road ship king
    apple house water green table chair bread stone river smile light night music plant
    garden orange window rocket engine dinner winter summer mother father silver pocket bottle
    kitchen teacher monster picture holiday morning weather journey history science library
    launcher computer elephant mountain keyboard sandwich umbrella hospital notebook triangle
    dinosaur airplane festival language calendar treasure question children football birthday
    chocolate butterfly adventure community president beautiful yesterday education direction
    blackboard basketball everything strawberry restaurant generation technology temperature
    carpenter waterfall newspaper microscope friendship government playground helicopter
    """.split()
)
