"""`moesweep serve`: a read-only web dashboard over the results database."""
