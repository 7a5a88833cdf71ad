from vllm_ext.tvq.cli import main

raise SystemExit(main())
