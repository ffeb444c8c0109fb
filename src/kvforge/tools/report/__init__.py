"""Results from measurements: provenance recorded in every result file, and `kvforge report`,
which renders the markdown tables in docs/ and README.md from the committed JSON."""
