"""The parts of eval/studies/ablation_report.py, the one command that runs them:

  load.py      a sweep folder read into trials, grouped into variants (a variant: the seeds of one setting)
  baseline.py  the unigram baseline of a trial's data, rebuilt from its train_config.yaml (--unigram)
  tables.py    the numbers per variant and their markdown table
  plots.py     the PNG plots
  report.py    write_report: report.md, report.json and the plots of one or more sweeps
"""
