from .worker import main

raise SystemExit(main())
