"""The drafter contract (design.md, Contract 2): config, modules, TTT attention, draft vocab, serving folder."""
