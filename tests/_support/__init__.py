"""Small helpers shared by tests (tiny encoders, batches); never imported by the package."""
