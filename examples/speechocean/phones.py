"""The targets: context-independent phone states, 3 per phone, 40 phones (120 classes).

Class ``3 * p + k`` is state ``k`` (0, 1, 2: left to right) of phone ``p`` of :data:`PHONES`;
silence is phone 0, so classes 0, 1, 2 are the silence classes (the HDF5 files'
``silence_classes``). The phones are the 39 ARPAbet phones of CMUdict (stress removed), the
set of both pocketsphinx's en-us model and the corpus's lexicon, plus ``SIL``.

Why phone states and not pocketsphinx's tied states (senones, ~3,500 seen on this corpus, the
shape of a production model's softmax): a senone is an internal index of pocketsphinx's
context-dependent model and its decision tree is not exposed, so a decoding graph over
senones (the context-dependency transducer C, the tree's question per state) cannot be built
from Python; phone states are what :mod:`examples.speechocean.graph` can turn into an HCLG
with kaldifst, the graph ``hadpsgd.decode --graph`` needs.
"""

from __future__ import annotations

PHONES = ("SIL", "AA", "AE", "AH", "AO", "AW", "AY", "B", "CH", "D", "DH", "EH", "ER", "EY",
          "F", "G", "HH", "IH", "IY", "JH", "K", "L", "M", "N", "NG", "OW", "OY", "P", "R", "S",
          "SH", "T", "TH", "UH", "UW", "V", "W", "Y", "Z", "ZH")
"""Phone ``p`` is ``PHONES[p]``; ``SIL`` first."""
STATES_PER_PHONE = 3
NUM_CLASSES = len(PHONES) * STATES_PER_PHONE
"""120 frame classes."""
SILENCE = "SIL"
SILENCE_CLASSES = (0, 1, 2)
"""The classes of ``SIL``."""
NOISE_PHONES = frozenset({"+NSN+", "+SPN+", "+NOISE+", "+SPEECH+"})
"""pocketsphinx's filler phones: counted as silence."""
_INDEX = {phone: index for index, phone in enumerate(PHONES)}


def phone_index(phone: str) -> int:
    """The index of ``phone`` (a filler phone is silence).

    Raises:
        KeyError: For a phone outside the set.
    """
    return _INDEX[SILENCE if phone in NOISE_PHONES else phone]


def state_class(phone: str, state: int) -> int:
    """The class of state ``state`` (0-based) of ``phone``.

    Raises:
        ValueError: For a state outside ``0..STATES_PER_PHONE - 1``.
    """
    if not 0 <= state < STATES_PER_PHONE:
        raise ValueError(f"state {state} of {phone}: a phone has {STATES_PER_PHONE} states")
    return STATES_PER_PHONE * phone_index(phone) + state


def class_name(cls: int) -> str:
    """``AH_1`` for class 10: the phone and state of a class."""
    return f"{PHONES[cls // STATES_PER_PHONE]}_{cls % STATES_PER_PHONE}"
