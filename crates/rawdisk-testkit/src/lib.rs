//! Test fixtures. STUB: filled in by the storage test suite.
