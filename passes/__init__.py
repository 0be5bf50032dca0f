"""FX and inductor passes over traced step graphs, one file per pass, plus the pass manager."""
