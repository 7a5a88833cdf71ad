from vllm_ext.etaps.cli import main

raise SystemExit(main())
