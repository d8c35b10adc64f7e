"""The dataset contract (design.md, Contract 1): format, fp8 codec, writer, reader."""
