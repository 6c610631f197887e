"""agents.episode.encode remembers texts per tokenizer: the n samples of a prompt tokenize it once."""

from rlhfkit.agents import episode


class CountingTokenizer:
    def __init__(self, offset: int = 0) -> None:
        self.calls, self.offset = 0, offset

    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        self.calls += 1
        return {"input_ids": [ord(c) + self.offset for c in text]}


def test_repeated_text_is_tokenized_once_and_results_are_independent_lists():
    tok = CountingTokenizer()
    a = episode.encode(tok, "abc")
    a.append(999)  # a caller may extend its list (multi-turn transcripts do)
    b = episode.encode(tok, "abc")
    assert b == [97, 98, 99] and tok.calls == 1
    assert episode.encode(tok, "abd") == [97, 98, 100] and tok.calls == 2


def test_cache_is_per_tokenizer_and_bounded(monkeypatch):
    t1, t2 = CountingTokenizer(), CountingTokenizer(offset=1000)
    assert episode.encode(t1, "x") == [120]
    assert episode.encode(t2, "x") == [1120]  # another tokenizer never sees t1's ids
    monkeypatch.setattr(episode, "_ENCODE_CACHE", 2)
    for text in ("p", "q", "r"):
        episode.encode(t1, text)
    calls = t1.calls
    episode.encode(t1, "x")  # evicted (oldest): tokenized again
    assert t1.calls == calls + 1
