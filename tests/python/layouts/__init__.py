"""Reference readers for checkpoint layouts statedict reads next (see README.md in this folder).

Each module reads the files alone, as the producer's own loader would, and never imports the
fixture generators (gen_olmo_st.py, gen_colossalai.py, gen_fairscale.py). The generators use these
readers to prove that what they wrote decodes back to the source model, and tests use them to judge
files statedict writes (layout_check.py).
"""
