//! Wire codec. STUB: filled in by the server issue.
