"""fusedloss benchmarks: one runner (``python benchmarks/run.py``), providers, suites.

Layout:
    run.py         command line: picks a suite, parses its options, runs it
    common.py      timing, peak memory, errors, environment, the options, statuses, the
                   result row and its check → memory → time sequence, report pieces and
                   plots every suite shares, results files
    inputs.py      input generators (the same inputs the peers' published figures use)
    providers.py   ours and the peers' implementations behind one small interface
    suites/        one module per suite (``lm-head`` …); each registers itself in SUITES
"""
