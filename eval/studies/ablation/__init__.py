"""The parts of eval/studies/ablation_report.py, the one command that runs them:

  load.py      a sweep folder read into trials, grouped into variants (a variant: the seeds of one setting)
  baseline.py  the unigram baseline of a trial's data, rebuilt from its train_config.yaml (--unigram)
  tables.py    the numbers per variant and their markdown table
  plots.py     the PNG plots
  report.py    write_report: report.md, report.json and the plots of one or more sweeps
  study2.py          the second edition's numbers (--study2): best loss, learning-rate sensitivity, plateau escape,
                     stability, wall clock, relative speed
  study2_plots.py    its plots; study2_section.py its section of the report and the second-seed YAML (--write_seed2)
"""
