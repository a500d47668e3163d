from fkv.cli import main

raise SystemExit(main())
